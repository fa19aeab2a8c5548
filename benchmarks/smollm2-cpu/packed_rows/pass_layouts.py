"""One batched pass of random trees on the embedded model, three ways, alternating,
``REPEATS`` times: padded (every tree padded to the largest), packed with attention row
by row, packed with one attention call over padded queries, and packed as the engine
chooses between the two. Prints each one's median time.

    .venv/bin/python benchmarks/smollm2-cpu/packed_rows/pass_layouts.py LENGTHS SIZES REPEATS

LENGTHS, SIZES: comma-separated, each row's context length and tree size.
"""

import statistics
import sys
import time

import numpy as np
import torch

import racer
import racer.engine.rows as rows_module
from racer.engine.rows import SlotRows
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier

lengths = [int(x) for x in sys.argv[1].split(",")]
sizes = [int(x) for x in sys.argv[2].split(",")]
repeats = int(sys.argv[3])
racer.use_threads(2)
model, _ = racer.load_model(dtype="float32")
rng = np.random.default_rng(0)
vocab = model.config.vocab_size
verifier = TreeVerifier(model)
rows = SlotRows(verifier, model.config, rows=len(lengths))
for length in lengths:
    prefilled = TreeVerifier(model, verifier.fast_paths, verifier.facts, verifier.layout)
    prefilled.prefill([int(t) for t in rng.integers(vocab, size=length)])
    rows.load(prefilled)
trees = [random_tree(rng, vocab, size, max(1, min(size - 1, 8))) for size in sizes]
# The share of padding below which one attention call is used: never, always, as shipped.
SHARES = {"packed, row by row": -10.0, "packed, one call": 1.0, "packed, as chosen": rows_module.PADDED_SHARE}


def run(layout: str) -> None:
    with torch.inference_mode():
        if layout == "padded":
            rows._padded_forward(trees)
            return
        rows_module.PADDED_SHARE = SHARES[layout]
        try:
            assert rows._packed_forward(trees, list(range(len(trees)))) is not None
        finally:
            rows_module.PADDED_SHARE = SHARES["packed, as chosen"]


times: dict[str, list[float]] = {layout: [] for layout in ("padded", *SHARES)}
for _ in range(3):
    for layout in times:
        run(layout)
for _ in range(repeats):
    for layout in times:
        start = time.perf_counter()
        run(layout)
        times[layout].append(time.perf_counter() - start)
for layout, seconds in times.items():
    print(f"{layout}: {1000 * statistics.median(seconds):.1f} ms")
