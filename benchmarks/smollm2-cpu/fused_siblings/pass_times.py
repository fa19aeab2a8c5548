"""One tree pass of 1, 4, 16 and 64 nodes after 300 cached tokens, on the packed kernel
with sibling layers fused and apart, alternating, ``REPEATS`` times each: median ms.

    .venv/bin/python benchmarks/smollm2-cpu/fused_siblings/pass_times.py REPEATS
"""

import statistics
import sys
import time

import numpy as np
import torch

import racer
import racer.fastpaths.kernels as kernels
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier

repeats = int(sys.argv[1])
racer.use_threads(2)
model, _ = racer.load_model(dtype="float32")
rng = np.random.default_rng(0)
vocab = model.config.vocab_size
siblings = kernels.packed_siblings
verifiers = {}
for variant in ("fused", "apart"):
    kernels.packed_siblings = siblings if variant == "fused" else (lambda model: [])
    verifier = TreeVerifier(model)
    verifier.use_kernel("packed")
    verifier.prefill([int(t) for t in rng.integers(vocab, size=300)])  # builds the forwards
    verifiers[variant] = verifier
kernels.packed_siblings = siblings
for size in (1, 4, 16, 64):
    seconds: dict[str, list[float]] = {v: [] for v in verifiers}
    for _ in range(repeats):
        tree = random_tree(rng, vocab, size, max(1, min(size - 1, 6)))
        for variant, verifier in verifiers.items():
            with torch.inference_mode():
                start = time.perf_counter()
                verifier.verify(tree)
                seconds[variant].append(time.perf_counter() - start)
            verifier.commit([], size)
    ms = {v: 1000 * statistics.median(s) for v, s in seconds.items()}
    print(f"{size:>2} nodes: fused {ms['fused']:.2f} ms, apart {ms['apart']:.2f} ms, ratio {ms['fused'] / ms['apart']:.3f}",
          flush=True)
