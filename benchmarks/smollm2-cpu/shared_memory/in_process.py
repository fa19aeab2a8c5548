"""RACER's drafter memory under concurrency, in process: one ``BatchDecoder`` of C rows
per variant, every request of the load in scope ``server``, greedy, 2 threads; the
variants run in turn each round (interleaved). Variants: ``kept`` (each drafter's own
memory travels with it, today's default), ``shared`` (``memory=shared``: the request's
own memory plus one shared automaton and copy-logit table), and the shared memory's
ablation: ``shared-index`` (its automaton only) and ``shared-table`` (its table only).
Per variant: tokens per pass of each request (median over requests), the share of the
drafter's trees that held nothing beyond the root (of the steps the budget drafted in),
accepted tokens from the shared memory, and tokens/s of the whole load. Writes in_process.json beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/shared_memory/in_process.py [C [LIMIT [ROUNDS [MAX_TOKENS]]]]

C: rows (8); LIMIT: questions per Spec-Bench category, HumanEval and MGSM (1); ROUNDS
(2); MAX_TOKENS (128).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.drafting.automaton import ROOT
from racer.drafting.racer import RacerDrafter
from racer.drafting.shared import SharedMemory

torch.set_num_threads(2)
rows, limit, rounds, max_tokens = ([int(a) for a in sys.argv[1:5]] + [8, 1, 2, 128][len(sys.argv) - 1:])[:4]
model, tokenizer = racer.load_model(dtype="float32")
questions = [q for d in ("spec_bench", "human_eval", "mgsm") for q in load_questions(d, limit)]


class IndexOnly(SharedMemory):
    def write(self, tokens, topk):
        pass

    def begin(self, prompt, prompt_topk):
        super().begin(prompt, None)


class TableOnly(SharedMemory):
    def state(self, context_tail):
        return ROOT  # a border of one token is below min_border: nothing retrieved


VARIANTS = {"kept": ("racer", None), "shared": ("racer:memory=shared", None),
            "shared-index": ("racer:memory=shared", IndexOnly), "shared-table": ("racer:memory=shared", TableOnly)}
cost = None
drafts = {"trees": 0, "empty": 0}
_draft = RacerDrafter.draft


def counted_draft(self, root, budget):
    tree = _draft(self, root, budget)
    drafts["trees"] += 1
    drafts["empty"] += len(tree) == 1
    return tree


RacerDrafter.draft = counted_draft


def run(variant: str) -> dict:
    global cost
    spec, store = VARIANTS[variant]
    engine = BatchDecoder(model, tokenizer, spec, max_batch=rows, cost=cost)
    cost = engine.cost
    if store is not None:
        build = engine.memory.build

        def build_with_store():
            drafter = build()
            drafter.new_shared = lambda: store(drafter.n, drafter.shared_nodes, drafter.k)
            return drafter

        engine.memory.build = build_with_store
    drafts.update(trees=0, empty=0)
    started = time.perf_counter()
    ids = [engine.submit(q.prompt, max_new_tokens=max_tokens, scope="server") for q in questions]
    while engine.busy:
        engine.step()
    wall = time.perf_counter() - started
    results = [engine.result(i) for i in ids]
    steps = [s for r in results for s in r.steps]  # one per request per step
    return {"tokens": sum(len(r.tokens) for r in results), "wall_s": wall,
            "tokens_per_pass": statistics.median(len(r.tokens) / (len(r.steps) + 1) for r in results),
            "empty_drafts": drafts["empty"] / max(drafts["trees"], 1), "drafted_steps": drafts["trees"] / len(steps),
            "accepted_shared": sum(r.drafter_stats.get("accepted_shared", 0) for r in results),
            "answers": [r.tokens for r in results]}


runs = {v: [] for v in VARIANTS}
for _ in range(rounds):
    for variant in VARIANTS:
        runs[variant].append(run(variant))
        print(variant, {k: v for k, v in runs[variant][-1].items() if k != "answers"}, flush=True)
reference = runs["kept"][0]["answers"]
summary = {v: {"tokens_per_pass": round(statistics.median(r["tokens_per_pass"] for r in rs), 3),
               "empty_drafts": round(statistics.median(r["empty_drafts"] for r in rs), 3),
               "drafted_steps": round(statistics.median(r["drafted_steps"] for r in rs), 3),
               "accepted_shared": statistics.median(r["accepted_shared"] for r in rs),
               "tokens_per_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 2),
               "answers_as_kept": all(r["answers"] == reference for r in rs)}
           for v, rs in runs.items()}
print(json.dumps(summary, indent=1))
Path(__file__).with_name("in_process.json").write_text(json.dumps(
    {"rows": rows, "limit": limit, "rounds": rounds, "max_tokens": max_tokens, "requests": len(questions),
     "summary": summary}, indent=1) + "\n")
