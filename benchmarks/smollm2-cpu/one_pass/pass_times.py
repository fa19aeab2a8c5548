"""A prompt chunk beside a step's trees, on the embedded model: the chunk in the trees'
pass ("ride") against the chunk's pass followed by the trees' own ("apart"), alternating,
``REPEATS`` times; also the trees' pass alone. Prints each one's median time and the
median saving of riding per step.

    .venv/bin/python benchmarks/smollm2-cpu/one_pass/pass_times.py LENGTHS SIZES PREFIX CHUNK REPEATS

LENGTHS, SIZES: comma-separated, each decoding row's context length and tree size;
PREFIX: the joining request's tokens already cached in its row; CHUNK: the chunk's
tokens. Nothing is committed: every pass writes the same positions again.
"""

import statistics
import sys
import time

import numpy as np
import torch

import racer
from racer.engine.rows import Chunk, Prompt, SlotRows
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier

lengths = [int(x) for x in sys.argv[1].split(",")]
sizes = [int(x) for x in sys.argv[2].split(",")]
prefix, size, repeats = (int(x) for x in sys.argv[3:6])
racer.use_threads(2)
model, _ = racer.load_model(dtype="float32")
rng = np.random.default_rng(0)
vocab = model.config.vocab_size
verifier = TreeVerifier(model)
rows = SlotRows(verifier, model.config, rows=len(lengths) + 1)
assert rows.packs
for length in lengths:
    prefilled = TreeVerifier(model, verifier.fast_paths, verifier.facts, verifier.layout)
    prefilled.prefill([int(t) for t in rng.integers(vocab, size=length)])
    rows.load(prefilled)
joining = TreeVerifier(model, verifier.fast_paths, verifier.facts, verifier.layout)
joining.prefill([int(t) for t in rng.integers(vocab, size=prefix)])
row = rows.load(joining)
trees = [random_tree(rng, vocab, n, max(1, min(n - 1, 8))) for n in sizes]
order = list(range(len(trees)))
tokens = [int(t) for t in rng.integers(vocab, size=size)]


def chunk() -> Chunk:
    rows.slots.state.lengths[row] = prefix  # the chunk's pass grew the row: back to where it was
    return Chunk(Prompt(prefix, row=row), tokens, 1)


def run(way: str) -> None:
    with torch.inference_mode():
        if way == "ride":
            rows.forward(trees, order, chunk())
        elif way == "apart":
            rows.forward([], [], chunk())
            rows.slots.state.lengths[row] = prefix
            rows.forward(trees, order)
        else:
            rows.slots.state.lengths[row] = prefix
            rows.forward(trees, order)


times: dict[str, list[float]] = {"ride": [], "apart": [], "trees alone": []}
for _ in range(2):
    for way in times:
        run(way)
for _ in range(repeats):
    for way in times:
        start = time.perf_counter()
        run(way)
        times[way].append(time.perf_counter() - start)
for way, seconds in times.items():
    print(f"{way}: {1000 * statistics.median(seconds):.1f} ms")
saving = statistics.median(a - r for a, r in zip(times["apart"], times["ride"]))
print(f"riding saves {1000 * saving:.1f} ms a step (median of pairs), "
      f"{saving / statistics.median(times['trees alone']):.2f} of the trees' own pass")
