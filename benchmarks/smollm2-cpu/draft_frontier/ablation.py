"""The proposer's two rate changes taken out one at a time, replayed (replay.py's racer mode):

    python ablation.py ANSWERS.pkl C METHOD FLOORS MODE[,MODE...]

MODE: ``means`` (chains chosen by the rates' means, not draws), ``own`` (an acceptance
model per drafter, not one per scope), ``means+own`` (both: the proposer before them,
with rows followed), ``as-is``. Appends to ``ablation.jsonl`` beside this file."""
import json, sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import replay  # noqa: E402
from racer.budget.acceptance import AcceptanceModel  # noqa: E402
from racer.engine.memory import DrafterMemory  # noqa: E402

path, c, method = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
floors = [float(f) for f in sys.argv[4].split(",")]
draws, memory_init = AcceptanceModel.probabilities, DrafterMemory.__init__
for mode in sys.argv[5].split(","):
    AcceptanceModel.probabilities, DrafterMemory.__init__ = draws, memory_init
    if "means" in mode.split("+"):
        AcceptanceModel.probabilities = lambda self, tree, explore=False: draws(self, tree, False)
    if "own" in mode.split("+"):
        DrafterMemory.__init__ = lambda self, *a, shared_rates=False, **k: memory_init(self, *a, **k)
    for result in replay.run_racer(path, c, method, floors):
        with open(HERE / "ablation.jsonl", "a") as f:
            f.write(json.dumps(dict(result, mode=mode)) + "\n")
