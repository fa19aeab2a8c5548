"""The decoder stack without transformers' per-call scaffolding ("lean",
``racer.fastpaths.stack``) against the model's own forward ("stock"), in process,
alternating on fresh engines, the order reversed every other round:

- one pass: a tree of 1, 8 and 32 nodes after 300 cached tokens, ``PASSES`` times each
  way, median milliseconds;
- the Spec-Bench/HumanEval mix at C = 1 (``PROMPTS`` questions one at a time) and at
  C = 8 (2 x ``PROMPTS`` questions all submitted at once), 128 tokens, greedy.

Tokens/s of each run, the median per-round ratio, whether every answer is the same both
ways. Float32, 2 threads, capacity auto. Writes ``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/lean_stack/compare.py METHODS ROUNDS PROMPTS PASSES
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths

methods, rounds, prompts, passes = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
VARIANTS = {"lean": FastPaths(), "stock": FastPaths(stack=False)}
mix = [q.chat for q in load_questions("spec_bench", limit=1)[:prompts] + load_questions("human_eval")[:prompts]]

rng = np.random.default_rng(0)
vocab = model.config.vocab_size
verifiers = {name: TreeVerifier(model, paths) for name, paths in VARIANTS.items()}
assert verifiers["lean"].stack is not None, "the lean stack was refused on this model"
context = [int(t) for t in rng.integers(vocab, size=300)]
for verifier in verifiers.values():
    verifier.use_kernel("packed")
    verifier.prefill(context)
pass_ms = {}
for size in (1, 8, 32):
    seconds = {name: [] for name in verifiers}
    for i in range(passes):
        tree = random_tree(rng, vocab, size, max(1, min(size - 1, 6)))
        logits = []
        for name in (("lean", "stock") if i % 2 == 0 else ("stock", "lean")):
            with torch.inference_mode():
                start = time.perf_counter()
                logits.append(verifiers[name].verify(tree))
                seconds[name].append(time.perf_counter() - start)
            verifiers[name].commit([], size)
        assert torch.equal(*logits), "the lean stack's logits differ"
    pass_ms[size] = {name: 1000 * statistics.median(s) for name, s in seconds.items()}
    print(f"{size:>2} nodes: lean {pass_ms[size]['lean']:.1f} ms, stock {pass_ms[size]['stock']:.1f} ms, "
          f"ratio {pass_ms[size]['lean'] / pass_ms[size]['stock']:.3f}", flush=True)


def one_at_a_time(engine: BatchDecoder) -> list:
    return [engine.generate_all([prompt], max_new_tokens=128)[0] for prompt in mix[:prompts]]


def all_at_once(engine: BatchDecoder) -> list:
    return engine.generate_all(mix, max_new_tokens=128)


LOADS = {"mix C=1": one_at_a_time, "mix C=8": all_at_once}
records = []
for method in methods:
    for round_ in range(rounds):
        for load, run in LOADS.items():
            for name in (("lean", "stock") if round_ % 2 == 0 else ("stock", "lean")):
                engine = BatchDecoder(model, tokenizer, method, max_batch=8, fast_paths=VARIANTS[name])
                engine.generate_all(["Hello"] * 8, max_new_tokens=8)
                began = time.perf_counter()
                results = run(engine)
                wall = time.perf_counter() - began
                tokens = sum(len(r.tokens) for r in results)
                records.append({"method": method, "round": round_, "load": load, "variant": name,
                                "tokens_s": tokens / wall, "answers": [r.tokens for r in results]})
                print(method, round_, load, name, f"{tokens / wall:.1f} tok/s", flush=True)
print("| method | load | lean tok/s | stock tok/s | lean / stock (median of rounds) | same answers |")
print("|---|---|---|---|---|---|")
summary = []
for method in methods:
    for load in LOADS:
        pick = {v: [r for r in records if (r["method"], r["load"], r["variant"]) == (method, load, v)]
                for v in VARIANTS}
        ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(pick["lean"], pick["stock"]))
        same = all(a["answers"] == b["answers"] for a, b in zip(pick["lean"], pick["stock"]))
        med = {v: statistics.median(r["tokens_s"] for r in rs) for v, rs in pick.items()}
        summary.append({"method": method, "load": load, "ratio": ratio, "same": same, **med})
        print(f"| {method} | {load} | {med['lean']:.1f} | {med['stock']:.1f} | {ratio:.3f} | {same} |")
Path(__file__).with_name("compare.json").write_text(json.dumps(
    {"pass_ms": pass_ms, "summary": summary,
     "runs": [{k: v for k, v in r.items() if k != "answers"} for r in records]}, indent=1) + "\n")
