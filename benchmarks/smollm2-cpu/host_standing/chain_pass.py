"""One request's verify pass of a chain of n tokens after a 1,000-token context, on the
engine's calibrated verifier (the embedded model, float32, 2 threads): the median of 10
passes per n, and the linear kernel the calibration picked for that width. How much of
a pass is fixed (the weights read once) and how much grows with the tokens verified.

    .venv/bin/python benchmarks/smollm2-cpu/host_standing/chain_pass.py
"""

import statistics
import time

import torch

import racer
from racer.drafting.tree import chain
from racer.engine.loop import BatchDecoder

racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
engine = BatchDecoder(model, tokenizer, "racer", max_batch=8, prefill_chunk=2048)
engine.calibrate()
verifier = engine.verifier
torch.manual_seed(0)
with torch.inference_mode():
    verifier.prefill(torch.randint(100, 40000, (1000,)).tolist())
    for n in (1, 2, 4, 8, 16, 32):
        times = []
        for _ in range(10):
            start = time.perf_counter()
            verifier.verify(chain(5, list(range(200, 200 + n - 1))))
            verifier.commit([0], n)  # keeps the root only: the context grows by one a pass
            times.append(time.perf_counter() - start)
        print(f"{n} tokens: {statistics.median(times) * 1000:.1f} ms ({verifier.kernel_of(n)} kernel)", flush=True)
