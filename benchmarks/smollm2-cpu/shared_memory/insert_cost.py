"""What a shared automaton costs, by capacity, after 10,000 requests: every prompt of the
shipped datasets (Spec-Bench, HumanEval, MGSM, code editing) written over and over until
10,000 requests have, its first half as a prompt (``SharedMemory.begin``) and the rest
token by token (``extend``), as live requests write, with eviction once full. Prints
microseconds per token, the process's resident memory growth, and the automaton's counts.

    .venv/bin/python benchmarks/smollm2-cpu/shared_memory/insert_cost.py [CAPACITY ...]
"""

import gc
import math
import sys
import time

from racer import load_tokenizer
from racer.bench.questions import DATASETS, load_questions
from racer.drafting.shared import SharedMemory

capacities = [int(a) for a in sys.argv[1:]] or [10_000, 30_000, 100_000]
tokenizer = load_tokenizer(None)
texts = [tokenizer.encode(q.prompt) for d in DATASETS for q in load_questions(d)]
rounds = math.ceil(10_000 / len(texts))
total = rounds * sum(map(len, texts))


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


for capacity in capacities:
    gc.collect()
    before = resident_mib()
    shared = SharedMemory(10, capacity, 8)
    started = time.perf_counter()
    for _ in range(rounds):
        for ids in texts:
            context = ids[: len(ids) // 2]
            shared.begin(context, None)
            for token in ids[len(ids) // 2 :]:
                context.append(token)
                shared.extend(context)
    seconds = time.perf_counter() - started
    print(f"capacity {capacity}: {seconds / total * 1e6:.1f} us/token over {total} tokens, "
          f"{resident_mib() - before:.0f} MiB resident more; {shared.stats()}", flush=True)
    del shared
