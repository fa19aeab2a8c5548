"""The packed kernel with sibling layers as one product ("fused": each block's query, key
and value projections, and its gate and up projections, over their weights packed side
by side) against separate products ("apart", as before), in process, alternating on
two engines that share the model:

- one 512-token prompt prefilled, ``REPEATS`` times each way, median;
- the Spec-Bench/HumanEval mix at C = 1 (4 prompts, one at a time) and at C = 8
  (``PROMPTS`` Spec-Bench questions, one per category, and ``PROMPTS`` HumanEval ones,
  all submitted at once), 128 tokens.

Tokens/s, the median per-round ratio, whether every answer is the same both ways.
Float32, 2 threads, capacity auto, the cost table as measured. Writes ``compare.json``.

    .venv/bin/python benchmarks/smollm2-cpu/fused_siblings/compare.py METHODS ROUNDS PROMPTS REPEATS
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import racer
import racer.fastpaths.kernels as kernels
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.engine.verifier import TreeVerifier

methods, rounds, prompts, repeats = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
mix = [q.chat for q in load_questions("spec_bench", limit=1)[:prompts] + load_questions("human_eval")[:prompts]]
siblings = kernels.packed_siblings


def built(variant: str, make):
    """``make()`` with its kernels' forwards built with siblings fused or apart."""
    kernels.packed_siblings = siblings if variant == "fused" else (lambda model: [])
    try:
        thing = make()
        return thing
    finally:
        kernels.packed_siblings = siblings


def verifier_of(variant: str) -> TreeVerifier:
    def make():
        verifier = TreeVerifier(model)
        verifier.use_kernel("packed")
        verifier.prefill(list(range(100, 612)))  # builds the forwards
        return verifier
    return built(variant, make)


def engine_of(variant: str, method: str, clients: int) -> BatchDecoder:
    def make():
        engine = BatchDecoder(model, tokenizer, method, max_batch=clients)
        engine.generate_all(["Hello"] * clients, max_new_tokens=8)  # calibrated, forwards built
        return engine
    return built(variant, make)


VARIANTS = ("fused", "apart")
verifiers = {v: verifier_of(v) for v in VARIANTS}
rng = np.random.default_rng(0)
prefill: dict[str, list[float]] = {v: [] for v in VARIANTS}
for _ in range(repeats):
    prompt = [int(t) for t in rng.integers(model.config.vocab_size, size=512)]
    for variant in VARIANTS:
        with torch.inference_mode():
            start = time.perf_counter()
            verifiers[variant].prefill(prompt)
            prefill[variant].append(time.perf_counter() - start)
prefill_ms = {v: 1000 * statistics.median(s) for v, s in prefill.items()}
print("prefill of 512 tokens, ms:", prefill_ms, flush=True)

LOADS = {"mix C=1": (1, mix[:2] + mix[prompts : prompts + 2]), "mix C=8": (8, mix)}
records = []
for method in methods:
    for round_ in range(rounds):
        for load, (clients, load_prompts) in LOADS.items():
            for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
                engine = engine_of(variant, method, clients)
                began = time.perf_counter()
                results = engine.generate_all(load_prompts, max_new_tokens=128)
                wall = time.perf_counter() - began
                tokens = sum(len(r.tokens) for r in results)
                records.append({"method": method, "round": round_, "load": load, "variant": variant,
                                "tokens_s": tokens / wall, "answers": [r.tokens for r in results]})
                print(method, round_, load, variant, f"{tokens / wall:.1f} tok/s", flush=True)
print("| method | load | fused tok/s | apart tok/s | fused / apart (median of rounds) | same answers |")
print("|---|---|---|---|---|---|")
for method in methods:
    for load in LOADS:
        pick = {v: [r for r in records if (r["method"], r["load"], r["variant"]) == (method, load, v)] for v in VARIANTS}
        ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(pick["fused"], pick["apart"]))
        same = all(a["answers"] == b["answers"] for a, b in zip(pick["fused"], pick["apart"]))
        med = {v: statistics.median(r["tokens_s"] for r in rs) for v, rs in pick.items()}
        print(f"| {method} | {load} | {med['fused']:.1f} | {med['apart']:.1f} | {ratio:.3f} | {same} |")
Path(__file__).with_name("compare.json").write_text(json.dumps(
    {"prefill_ms": prefill_ms, "loads": [{k: v for k, v in r.items() if k != "answers"} for r in records]},
    indent=1) + "\n")
