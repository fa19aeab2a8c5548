"""RACER with the deep chain (``racer``, ``deep=32``) against RACER's tree alone
(``racer:deep=0``), in process, the two runs of each load alternating, ``ROUNDS`` times:

- agent sessions at C = 1 and C = 8 (eight sessions' four calls each, a session's next
  call submitted when its last one ends, scope "server", kept prefixes of 512 MiB);
- code editing, Spec-Bench and HumanEval, ``PROMPTS`` prompts each, one at a time.

Every load: 256 tokens at most, capacity auto (the draft budget), float32, 2 threads.
Prints tokens/s, tokens per request per pass, nodes per request per pass, the accepted
tokens the deep chain drafted, and whether every answer is the same under both; writes
``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/deep_chain/compare.py ROUNDS PROMPTS
"""

import json
import statistics
import sys
import time
from pathlib import Path

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions

rounds, prompts = (int(a) for a in sys.argv[1:3])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
SPECS = ("racer", "racer:deep=0")
agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i : i + 4] for i in range(0, 32, 4)]


def sessions_run(spec: str, clients: int) -> dict:
    engine = BatchDecoder(model, tokenizer, spec, max_batch=clients, prefix_cache_mib=512)
    engine.generate_all(["Hello"], max_new_tokens=4)
    waiting = list(range(len(sessions)))
    pending, answers = {}, {}
    tokens = passes = nodes = deep = 0

    def start(session: int, call: int) -> None:
        pending[engine.submit(sessions[session][call].chat, max_new_tokens=256, scope="server")] = (session, call)

    for _ in range(clients):
        start(waiting.pop(0), 0)
    began = time.perf_counter()
    while engine.busy:
        for update in engine.step():
            if update.done and update.request in pending:
                session, call = pending.pop(update.request)
                result = engine.result(update.request)
                answers[(session, call)] = result.tokens
                tokens, passes = tokens + len(result.tokens), passes + len(result.steps)
                nodes += sum(step.tree_size for step in result.steps)
                deep += result.drafter_stats.get("accepted_deep", 0)
                if call + 1 < 4:
                    start(session, call + 1)
                elif waiting:
                    start(waiting.pop(0), 0)
    wall = time.perf_counter() - began
    return {"tokens_s": tokens / wall, "tokens_per_pass": tokens / passes, "nodes_per_pass": nodes / passes,
            "deep_share": deep / tokens, "answers": {f"{s}.{c}": a for (s, c), a in sorted(answers.items())}}


def single_run(spec: str, questions: list) -> dict:
    engine = BatchDecoder(model, tokenizer, spec, max_batch=1)
    engine.generate_all(["Hello"], max_new_tokens=4)
    tokens = passes = nodes = deep = 0
    answers = {}
    began = time.perf_counter()
    for question in questions:
        result = engine.generate_all([question.chat], max_new_tokens=256)[0]
        answers[question.question_id] = result.tokens
        tokens, passes = tokens + len(result.tokens), passes + len(result.steps)
        nodes += sum(step.tree_size for step in result.steps)
        deep += result.drafter_stats.get("accepted_deep", 0)
    wall = time.perf_counter() - began
    return {"tokens_s": tokens / wall, "tokens_per_pass": tokens / passes, "nodes_per_pass": nodes / passes,
            "deep_share": deep / tokens, "answers": answers}


loads = {"agent C=1": lambda spec: sessions_run(spec, 1), "agent C=8": lambda spec: sessions_run(spec, 8)}
for dataset in ("code_edit", "spec_bench", "human_eval"):
    questions = load_questions(dataset, limit=prompts)
    loads[dataset] = lambda spec, q=questions: single_run(spec, q)
records = []
for round_ in range(rounds):
    for load, run in loads.items():
        order = SPECS if round_ % 2 == 0 else SPECS[::-1]
        for spec in order:
            row = run(spec)
            records.append({"round": round_, "load": load, "spec": spec, **row})
            print(round_, load, spec, {k: round(v, 3) for k, v in row.items() if k != "answers"}, flush=True)
print("| load | racer tok/s | deep=0 tok/s | ratio (median) | tokens/pass racer | deep=0 | nodes/pass racer | "
      "deep=0 | deep chain's share | same answers |")
print("|---|---|---|---|---|---|---|---|---|---|")
for load in loads:
    rows = {spec: [r for r in records if r["load"] == load and r["spec"] == spec] for spec in SPECS}
    ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(*rows.values()))
    med = {spec: {key: statistics.median(r[key] for r in rs) for key in
                  ("tokens_s", "tokens_per_pass", "nodes_per_pass", "deep_share")} for spec, rs in rows.items()}
    same = all(a["answers"] == b["answers"] for a, b in zip(*rows.values()))
    a, b = med["racer"], med["racer:deep=0"]
    print(f"| {load} | {a['tokens_s']:.1f} | {b['tokens_s']:.1f} | {ratio:.3f} | {a['tokens_per_pass']:.2f} | "
          f"{b['tokens_per_pass']:.2f} | {a['nodes_per_pass']:.1f} | {b['nodes_per_pass']:.1f} | "
          f"{a['deep_share']:.1%} | {same} |")
Path(__file__).with_name("compare.json").write_text(
    json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in records], indent=1) + "\n")
