"""Resident memory of the embedded model (float32) before and after the packed kernel's
weights are built, and one packed tree pass's logits, printed as a checksum so that two
checkouts can be compared (the same bits both ways).

    PYTHONPATH=SRC .venv/bin/python benchmarks/smollm2-cpu/packed_memory/rss.py
"""

import hashlib

import numpy as np
import torch

import racer
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


racer.use_threads(2)
model, _ = racer.load_model(dtype="float32")
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
loaded = rss_mib()
verifier = TreeVerifier(model)
verifier.use_kernel("packed")  # builds the packed weights
built = rss_mib()
rng = np.random.default_rng(0)
verifier.prefill([int(t) for t in rng.integers(model.config.vocab_size, size=300)])
with torch.inference_mode():
    logits = verifier.verify(random_tree(rng, model.config.vocab_size, 16, 6))
digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16]
print(f"model weights {weights:.0f} MiB; RSS loaded {loaded:.0f} MiB, with packed weights {built:.0f} MiB "
      f"(+{built - loaded:.0f} MiB); 16-node pass logits sha256 {digest}")
