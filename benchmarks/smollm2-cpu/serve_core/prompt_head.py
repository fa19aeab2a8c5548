"""TTFT of racer with the copy-logit table's LM head in the prefill pass (as before) and
after the first token has left (``racer.engine.prompt_head``), and whether the tables
and answers are the same: two one-row engines on the same model, every question
decoded by each in turn (interleaved), greedy, 2 threads. TTFT is the time from
``submit`` to the step's ``early`` hand-out of the first token. Writes prompt_head.json
beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/serve_core/prompt_head.py [LIMIT [ROUNDS [MAX_TOKENS]]]

LIMIT: questions per category (2); ROUNDS: times over them (2); MAX_TOKENS: each
answer's length (16).
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

torch.set_num_threads(2)
limit, rounds, max_tokens = ([int(a) for a in sys.argv[1:4]] + [2, 2, 16][len(sys.argv) - 1:])[:3]
model, tokenizer = racer.load_model(dtype="float32")
questions = [q for d in ("spec_bench", "human_eval", "mgsm") for q in load_questions(d, limit)]
engines = {"in_pass": BatchDecoder(model, tokenizer, "racer", max_batch=1, check=False),
           "after_first_token": BatchDecoder(model, tokenizer, "racer", max_batch=1, check=False)}
engines["in_pass"].prompt_head.trusted = False  # the prefill pass computes every position's logits
runs = {mode: [] for mode in engines}
for _ in range(rounds):
    for question in questions:
        for mode, engine in engines.items():
            tables, begin = [], engine.memory.begin
            engine.memory.begin = lambda scope, ids, topk, begin=begin: tables.append(topk) or begin(scope, ids, topk)
            first: list[float] = []
            started = time.perf_counter()
            request = engine.submit(question.prompt, max_new_tokens=max_tokens)
            while engine.busy:
                engine.step(early=lambda updates: first.append(time.perf_counter() - started))
            engine.memory.begin = begin
            runs[mode].append({"ttft_s": first[0], "tokens": engine.result(request).tokens, "table": tables[0]})
pairs = list(zip(runs["in_pass"], runs["after_first_token"]))
rows = sum(a["table"].shape[0] for a, _ in pairs)
same_rows = sum(int((a["table"] == b["table"]).all(axis=1).sum()) for a, b in pairs
                if a["table"].shape == b["table"].shape)
summary = {
    "decodes_per_mode": len(pairs),
    "prompt_tokens_median": statistics.median(a["table"].shape[0] for a, _ in pairs),
    "table_rows_identical": f"{same_rows}/{rows}",
    "answers_identical": all(a["tokens"] == b["tokens"] for a, b in pairs),
    "ttft_median_s": {mode: round(statistics.median(r["ttft_s"] for r in runs[mode]), 4) for mode in runs},
    "ttft_ratio_median": round(statistics.median(b["ttft_s"] / a["ttft_s"] for a, b in pairs), 3),
}
print(json.dumps(summary, indent=1))
Path(__file__).with_name("prompt_head.json").write_text(json.dumps(
    {"limit": limit, "rounds": rounds, "max_tokens": max_tokens, "summary": summary}, indent=1) + "\n")
