"""Packed batched passes (the rows' trees one after another, the batch budget choosing
nodes across rows) against padded ones (every tree padded to the largest, one node cap
for the step), in process, the two runs of each load alternating, ``ROUNDS`` times:

- agent sessions at C = 4 and C = 8 (eight sessions' four calls each, a session's next
  call submitted when its last one ends, scope "server", kept prefixes of 512 MiB);
- a mix of ``PROMPTS`` Spec-Bench and ``PROMPTS`` HumanEval questions at C = 8, all
  submitted at once.

Every load: RACER, 256 tokens at most, capacity auto (the draft budget), float32,
2 threads. Prints tokens/s, tokens per request per pass, nodes per request per pass and
whether every answer is the same under both; writes ``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/packed_rows/compare.py ROUNDS PROMPTS
"""

import json
import statistics
import sys
import time
from pathlib import Path

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.fastpaths import FastPaths

rounds, prompts = (int(a) for a in sys.argv[1:3])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
VARIANTS = {"packed": FastPaths(), "padded": FastPaths(packed_rows=False)}
agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i : i + 4] for i in range(0, 32, 4)]
mix = [q.chat for q in load_questions("spec_bench", limit=prompts) + load_questions("human_eval", limit=prompts)]


def engine_of(variant: str, clients: int) -> BatchDecoder:
    engine = BatchDecoder(model, tokenizer, "racer", max_batch=clients, prefix_cache_mib=512,
                          fast_paths=VARIANTS[variant])
    engine.generate_all(["Hello"] * 2, max_new_tokens=4)
    return engine


def summary(engine: BatchDecoder, results: list, wall: float) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    passes = sum(len(r.steps) for r in results)
    nodes = sum(step.tree_size for r in results for step in r.steps)
    return {"tokens_s": tokens / wall, "tokens_per_pass": tokens / passes, "nodes_per_pass": nodes / passes,
            "packs": engine.rows.packs, "answers": [r.tokens for r in results]}


def sessions_run(variant: str, clients: int) -> dict:
    engine = engine_of(variant, clients)
    waiting = list(range(len(sessions)))
    pending, results = {}, {}

    def start(session: int, call: int) -> None:
        pending[engine.submit(sessions[session][call].chat, max_new_tokens=256, scope="server")] = (session, call)

    for _ in range(clients):
        start(waiting.pop(0), 0)
    began = time.perf_counter()
    while engine.busy:
        for update in engine.step():
            if update.done and update.request in pending:
                session, call = pending.pop(update.request)
                results[(session, call)] = engine.result(update.request)
                if call + 1 < 4:
                    start(session, call + 1)
                elif waiting:
                    start(waiting.pop(0), 0)
    wall = time.perf_counter() - began
    return summary(engine, [results[key] for key in sorted(results)], wall)


def mix_run(variant: str, clients: int) -> dict:
    engine = engine_of(variant, clients)
    began = time.perf_counter()
    results = engine.generate_all(mix, max_new_tokens=256)
    return summary(engine, results, time.perf_counter() - began)


loads = {"agent C=4": lambda v: sessions_run(v, 4), "agent C=8": lambda v: sessions_run(v, 8),
         "mix C=8": lambda v: mix_run(v, 8)}
records = []
for round_ in range(rounds):
    for load, run in loads.items():
        for variant in (VARIANTS if round_ % 2 == 0 else list(VARIANTS)[::-1]):
            row = run(variant)
            records.append({"round": round_, "load": load, "variant": variant, **row})
            print(round_, load, variant, {k: (round(v, 3) if isinstance(v, float) else v)
                                          for k, v in row.items() if k != "answers"}, flush=True)
print("| load | packed tok/s | padded tok/s | ratio (median) | tokens/pass packed | padded | nodes/pass packed | "
      "padded | same answers |")
print("|---|---|---|---|---|---|---|---|---|")
for load in loads:
    rows = {v: [r for r in records if r["load"] == load and r["variant"] == v] for v in VARIANTS}
    ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(*rows.values()))
    med = {v: {key: statistics.median(r[key] for r in rs) for key in ("tokens_s", "tokens_per_pass", "nodes_per_pass")}
           for v, rs in rows.items()}
    same = all(a["answers"] == b["answers"] for a, b in zip(*rows.values()))
    a, b = med["packed"], med["padded"]
    print(f"| {load} | {a['tokens_s']:.1f} | {b['tokens_s']:.1f} | {ratio:.3f} | {a['tokens_per_pass']:.2f} | "
          f"{b['tokens_per_pass']:.2f} | {a['nodes_per_pass']:.1f} | {b['nodes_per_pass']:.1f} | {same} |")
Path(__file__).with_name("compare.json").write_text(
    json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in records], indent=1) + "\n")
