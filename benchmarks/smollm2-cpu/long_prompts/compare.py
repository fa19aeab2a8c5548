"""The prompt's LM head at every position (on the model's own layer) against only each
token's latest position (on the oneDNN-packed head where the verifier built one): two
one-row racer engines (capacity 16, so that the same table drafts the same trees),
every prompt decoded by each in turn, in a rotating order. Prints, per dataset, the
prefill seconds (the prompt's passes and the head's work before the first draft), the
tokens per pass, and whether the answers and the number of passes are the same;
writes the rows to ``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/long_prompts/compare.py THREADS PROMPTS TOKENS
"""

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.drafting import parse_method

threads, per_dataset, tokens = (int(a) for a in sys.argv[1:4])
racer.use_threads(threads)
model, tokenizer = racer.load_model(dtype="float32")


def engine(rows: str) -> BatchDecoder:
    drafter = parse_method("racer:memory=fresh").drafter
    drafter.needs = replace(drafter.needs, prompt_rows=rows)
    built = BatchDecoder(model, tokenizer, drafter, max_batch=1, capacity=16)  # fixed: passes compare
    if rows == "every":
        built.prompt_head.kernels = None  # the head on the model's own layer, as before
    return built


engines = {"every": engine("every"), "latest": engine("latest")}
for built in engines.values():  # calibrate and warm up
    built.generate_all(["Hello"], max_new_tokens=4)
records = []
for dataset in ("agent_sessions", "code_edit", "spec_bench"):
    questions = load_questions(dataset, limit=per_dataset * (4 if dataset == "agent_sessions" else 1))
    if dataset == "agent_sessions":
        questions = questions[3::4][:per_dataset]  # each session's last, longest call
    for index, question in enumerate(questions):
        order = list(engines) if index % 2 == 0 else list(reversed(engines))
        row = {"dataset": dataset, "id": question.question_id}
        for name in order:
            result = engines[name].generate_all([question.chat], max_new_tokens=tokens)[0]
            row[name] = {"prompt": result.prompt_tokens, "prefill_s": result.prefill_s, "passes": len(result.steps),
                         "tokens": result.tokens}
        records.append(row)
print(f"{threads} threads, {tokens} tokens; prefill seconds (sum) and tokens per pass")
print("| dataset | prompts | prompt tokens (median) | prefill every | prefill latest | ratio (median) | "
      "tokens/pass every | latest | same answers | same passes |")
print("|---|---|---|---|---|---|---|---|---|---|")
for dataset in dict.fromkeys(r["dataset"] for r in records):
    rows = [r for r in records if r["dataset"] == dataset]
    every = sum(r["every"]["prefill_s"] for r in rows)
    latest = sum(r["latest"]["prefill_s"] for r in rows)
    ratio = statistics.median(r["latest"]["prefill_s"] / r["every"]["prefill_s"] for r in rows)
    tpp = {n: sum(len(r[n]["tokens"]) for r in rows) / sum(r[n]["passes"] for r in rows) for n in engines}
    same = sum(r["every"]["tokens"] == r["latest"]["tokens"] for r in rows)
    passes = sum(r["every"]["passes"] == r["latest"]["passes"] for r in rows)
    print(f"| {dataset} | {len(rows)} | {statistics.median(r['every']['prompt'] for r in rows):.0f} | {every:.2f} s | "
          f"{latest:.2f} s | {ratio:.3f} | {tpp['every']:.3f} | {tpp['latest']:.3f} | {same}/{len(rows)} | "
          f"{passes}/{len(rows)} |")
Path(__file__).with_name("compare.json").write_text(json.dumps(records, indent=1))
