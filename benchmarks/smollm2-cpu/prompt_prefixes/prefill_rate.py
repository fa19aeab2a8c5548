"""racer's prefill, tokens per second: ``TreeVerifier.prefill`` of random prompts of
each length on the embedded model (float32, 2 threads), best of 3, with the model's own
linear layers and with the packed oneDNN kernel (the one the engine's calibration
picks for prompt chunks on this host).

    .venv/bin/python benchmarks/smollm2-cpu/prompt_prefixes/prefill_rate.py 256,512,1024
"""

import sys
import time

import numpy as np
import torch

import racer
from racer.engine.verifier import TreeVerifier

racer.use_threads(2)
model, _ = racer.load_model(dtype="float32")
rng = np.random.default_rng(0)
for length in (int(n) for n in sys.argv[1].split(",")):
    ids = [int(t) for t in rng.integers(1000, 40000, size=length)]
    for kernel in ("model", "packed"):
        best = float("inf")
        for _ in range(3):
            verifier = TreeVerifier(model)
            verifier.use_kernel(kernel)
            start = time.perf_counter()
            with torch.inference_mode():
                verifier.prefill(ids)
            best = min(best, time.perf_counter() - start)
        print(f"racer {kernel}: {length} tokens in {best:.3f} s, {length / best:.0f} tokens/s", flush=True)
