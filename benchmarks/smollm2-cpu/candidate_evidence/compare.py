"""The acceptance model learning from every candidate node the drafter proposed whose
outcome a greedy request's emitted tokens settle ("candidates",
``AcceptanceModel.observe_truth``) against learning from the verified nodes only
("verified", the rule before it), in process, alternating, a fresh engine for every run
(drafters and acceptance models kept between requests under scope "server", as
``racer serve`` keeps them), the order reversed every other round:

- the Spec-Bench/HumanEval mix at C = 8: ``PROMPTS`` Spec-Bench questions (one per
  category) and ``PROMPTS`` HumanEval ones, all submitted at once, 128 tokens;
- the same prompts at C = 1, one at a time, 128 tokens;
- ``none`` on the same loads, as the plain decoding they are measured against.

Tokens/s of each run, the median per-round ratio, whether every answer is the same both
ways (and the same as ``none``'s). Float32, 2 threads, capacity auto. Writes
``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/candidate_evidence/compare.py ROUNDS PROMPTS [WORKLOAD]

WORKLOAD: ``mix`` (default) or a dataset name (``code_edit``: its first 2 x PROMPTS
requests, in the same two loads); the JSON is ``compare.json`` or ``compare-WORKLOAD.json``.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.engine.memory import DraftSession

rounds, prompts = int(sys.argv[1]), int(sys.argv[2])
workload = sys.argv[3] if len(sys.argv) > 3 else "mix"
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
if workload == "mix":
    mix = [q.chat for q in load_questions("spec_bench", limit=1)[:prompts] + load_questions("human_eval")[:prompts]]
else:  # 2 x PROMPTS requests of another set, one of each category (code_edit: kind) in turn
    by_category: dict = {}
    for question in load_questions(workload):
        by_category.setdefault(question.category, []).append(question.chat)
    turns = [group[i] for i in range(max(map(len, by_category.values()))) for group in by_category.values()
             if i < len(group)]
    mix = turns[: 2 * prompts]
observe = DraftSession.observe


def verified_only(self, tree, tree_topk, accepted, rated=True, candidates=None, truth=None):
    observe(self, tree, tree_topk, accepted, rated)


VARIANTS = {"candidates": observe, "verified": verified_only}


def run(engine: BatchDecoder, batch: int) -> tuple[float, list]:
    start = time.perf_counter()
    if batch == 1:
        results = [engine.generate_all([prompt], max_new_tokens=128, scope="server")[0] for prompt in mix]
    else:
        results = engine.generate_all(mix, max_new_tokens=128, scope="server")
    seconds = time.perf_counter() - start
    return sum(len(r.tokens) for r in results) / seconds, [r.tokens for r in results]


engines = {method: BatchDecoder(model, tokenizer, method, max_batch=8) for method in ("none", "racer")}
for engine in engines.values():
    engine.generate_all(mix[:8], max_new_tokens=32)  # calibration and a first run of this shape
rows = []
for round_ in range(rounds):
    for batch in (8, 1):
        order = [("none", "none"), ("racer", "candidates"), ("racer", "verified")]
        order = order if round_ % 2 == 0 else order[::-1]
        answers = {}
        for method, variant in order:
            DraftSession.observe = VARIANTS.get(variant, observe)
            engine = engines[method].fresh()
            engine.memory = engines[method].memory.__class__(engine._new_drafter, engine.method.auto, 32)
            rate, answers[variant] = run(engine, batch)
            rows.append({"round": round_, "C": batch, "method": method, "variant": variant, "tokens_per_s": rate})
            print(f"round {round_} C={batch} {method} {variant}: {rate:.1f} tok/s", flush=True)
        DraftSession.observe = observe
        same = answers["candidates"] == answers["verified"] == answers["none"]
        rows.append({"round": round_, "C": batch, "same_answers": same})
        print(f"round {round_} C={batch}: same answers {same}", flush=True)
summary = {}
for batch in (8, 1):
    rate = {v: [r["tokens_per_s"] for r in rows if r.get("variant") == v and r["C"] == batch]
            for v in ("none", "candidates", "verified")}
    ratios = [c / v for c, v in zip(rate["candidates"], rate["verified"])]
    summary[f"C={batch}"] = {"candidates / verified (median of rounds)": statistics.median(ratios),
                             "candidates / none": statistics.median(c / n for c, n in zip(rate["candidates"], rate["none"])),
                             "verified / none": statistics.median(v / n for v, n in zip(rate["verified"], rate["none"])),
                             "median tok/s": {k: statistics.median(x) for k, x in rate.items()},
                             "same answers": all(r["same_answers"] for r in rows if "same_answers" in r and r["C"] == batch)}
print(json.dumps(summary, indent=1))
(Path(__file__).parent / ("compare.json" if workload == "mix" else f"compare-{workload}.json")).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
