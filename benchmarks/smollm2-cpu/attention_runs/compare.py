"""A packed pass's tree rows attended in runs of least modelled cost (``padded_groups``,
"runs") against the rule before it ("share": every row in one padded call where padding
adds at most a quarter of the positions attended and the pass holds rows 0..B-1 in
order, else every row on its own), in process, alternating, a fresh engine for every run:

- the Spec-Bench/HumanEval mix at C = 8: ``PROMPTS`` Spec-Bench questions (one per
  category) and ``PROMPTS`` HumanEval ones, all submitted at once, 128 tokens;
- agent sessions at C = 8: eight sessions' first two calls, a session's next call
  submitted when its last one ends, scope "server", kept prefixes of 512 MiB, 256 tokens.

Tokens/s of each run, the median per-round ratio, whether every answer is the same both
ways. Float32, 2 threads, capacity auto. Writes ``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/attention_runs/compare.py METHODS ROUNDS PROMPTS
"""

import json
import statistics
import sys
import time
from pathlib import Path

import racer
import racer.engine.rows as rows_module
from racer import BatchDecoder
from racer.bench.questions import load_questions

methods, rounds, prompts = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
runs_rule = rows_module.padded_groups


def share_rule(rows, sizes, spans):
    """The rule before ``padded_groups``."""
    alike = sum(n * span for n, span in zip(sizes, spans)) >= 0.75 * len(sizes) * max(sizes) * max(spans)
    if alike and list(rows) == list(range(len(rows))):
        return [(0, len(rows))]
    return [(i, i + 1) for i in range(len(rows))]


RULES = {"runs": runs_rule, "share": share_rule}
agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i : i + 2] for i in range(0, 32, 4)]
mix = [q.chat for q in load_questions("spec_bench", limit=1)[:prompts] + load_questions("human_eval")[:prompts]]


def drive(engine: BatchDecoder, submit_next) -> None:
    while engine.busy:
        for update in engine.step():
            if update.done:
                submit_next(update.request)


def agent_run(engine: BatchDecoder) -> list:
    waiting, pending, results = list(range(len(sessions))), {}, {}

    def start(session: int, call: int) -> None:
        pending[engine.submit(sessions[session][call].chat, max_new_tokens=256, scope="server")] = (session, call)

    def submit_next(request: int) -> None:
        session, call = pending.pop(request)
        results[(session, call)] = engine.result(request)
        if call + 1 < len(sessions[session]):
            start(session, call + 1)
        elif waiting:
            start(waiting.pop(0), 0)

    for _ in range(8):
        start(waiting.pop(0), 0)
    drive(engine, submit_next)
    return [results[key] for key in sorted(results)]


def mix_run(engine: BatchDecoder) -> list:
    ids = [engine.submit(prompt, max_new_tokens=128) for prompt in mix]
    drive(engine, lambda request: None)
    return [engine.result(i) for i in ids]


LOADS = {"mix C=8": mix_run, "agent C=8": agent_run}
records = []


def engine_of(method: str) -> BatchDecoder:
    """A fresh engine (nothing kept from another run), calibrated and warm."""
    engine = BatchDecoder(model, tokenizer, method, max_batch=8, prefix_cache_mib=512)
    engine.generate_all(["Hello"] * 8, max_new_tokens=8)
    return engine


for method in methods:
    for round_ in range(rounds):
        for load, run in LOADS.items():
            for rule in (("runs", "share") if round_ % 2 == 0 else ("share", "runs")):
                rows_module.padded_groups = RULES[rule]
                engine = engine_of(method)
                began = time.perf_counter()
                results = run(engine)
                wall = time.perf_counter() - began
                tokens = sum(len(r.tokens) for r in results)
                records.append({"method": method, "round": round_, "load": load, "rule": rule,
                                "tokens_s": tokens / wall, "answers": [r.tokens for r in results]})
                print(method, round_, load, rule, f"{tokens / wall:.1f} tok/s", flush=True)
rows_module.padded_groups = runs_rule
print("| method | load | runs tok/s | share tok/s | runs / share (median of rounds) | same answers |")
print("|---|---|---|---|---|---|")
for method in methods:
    for load in LOADS:
        pick = {rule: [r for r in records if (r["method"], r["load"], r["rule"]) == (method, load, rule)]
                for rule in RULES}
        ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(pick["runs"], pick["share"]))
        same = all(a["answers"] == b["answers"] for a, b in zip(pick["runs"], pick["share"]))
        med = {rule: statistics.median(r["tokens_s"] for r in rs) for rule, rs in pick.items()}
        print(f"| {method} | {load} | {med['runs']:.1f} | {med['share']:.1f} | {ratio:.3f} | {same} |")
Path(__file__).with_name("compare.json").write_text(json.dumps(
    [{k: v for k, v in r.items() if k != "answers"} for r in records], indent=1) + "\n")
