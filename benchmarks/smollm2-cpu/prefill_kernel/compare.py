"""Prompt chunks on the linear kernel the cost table measured fastest for them ("table",
the engine's rule) against the model's own layers ("model", what prompts ran on before),
in process, alternating:

1. one prompt chunk of 512 tokens after 0, 1,000 and 2,000 cached tokens, on a row of
   a ``SlotRows`` (a pass of its own, as the engine prefills a prompt's last chunk),
   ``REPEATS`` times each way, medians;
2. ``ROUNDS`` rounds of agent sessions at C = 8 (eight sessions' four calls each, a
   session's next call submitted when its last one ends, scope "server") with kept
   prefixes of 512 MiB and without, and, with ``PROMPTS`` > 0, ``PROMPTS`` Spec-Bench
   and ``PROMPTS`` HumanEval questions at C = 8, all submitted at once: tokens/s, time
   to first token (p50), prefill's share of the engine's time, whether every answer is
   the same both ways.

RACER, 256 tokens at most, capacity auto, float32, 2 threads, chunks of 512 tokens.
Writes ``compare.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/prefill_kernel/compare.py REPEATS ROUNDS PROMPTS
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
from racer.engine.rows import Chunk

repeats, rounds, prompts = (int(a) for a in sys.argv[1:4])
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
WIDE = 160  # passes at least this wide: prompt chunks (the table's trees stop at 64 nodes)


def on_model_layers(engine: BatchDecoder) -> BatchDecoder:
    """``engine`` with its prompt chunks on the model's own layers, its trees as before."""
    verifier, table_kernel = engine.verifier, engine.verifier.kernel_of
    verifier.kernel_of = lambda n: "model" if n >= WIDE else table_kernel(n)
    return engine


def engine_of(variant: str, clients: int, kept: int = 512) -> BatchDecoder:
    engine = BatchDecoder(model, tokenizer, "racer", max_batch=clients, prefix_cache_mib=kept)
    engine.generate_all(["Hello"] * 2, max_new_tokens=4)  # calibrated, warm
    return on_model_layers(engine) if variant == "model" else engine


def chunk_times() -> list[dict]:
    engines = {variant: engine_of(variant, 2, 0) for variant in ("table", "model")}
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    rows_out = []
    for cached in (0, 1000, 2000):
        seconds: dict[str, list[float]] = {variant: [] for variant in engines}
        for _ in range(repeats + 1):  # the first of each: warm-up, dropped
            for variant, engine in engines.items():
                rows = engine.rows
                prompt = rows.begin_prompt([int(t) for t in rng.integers(vocab, size=cached + 512)])
                with torch.inference_mode():
                    if cached:
                        rows.prefill(Chunk(prompt, [int(t) for t in rng.integers(vocab, size=cached)], 1))
                    start = time.perf_counter()
                    rows.prefill(Chunk(prompt, [int(t) for t in rng.integers(vocab, size=512)], 1))
                    seconds[variant].append(time.perf_counter() - start)
                rows.release(prompt.row)
        row = {"cached": cached, **{v: 1000 * statistics.median(s[1:]) for v, s in seconds.items()},
               "kernel": engines["table"].verifier.kernel_of(512)}
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i : i + 4] for i in range(0, 32, 4)]
mix = ([q.chat for q in load_questions("spec_bench", limit=prompts) + load_questions("human_eval", limit=prompts)]
       if prompts else [])


def summary(engine: BatchDecoder, results: list, wall: float, first: dict, submitted: dict) -> dict:
    ttft = [first[i] - submitted[i] for i in first]
    return {"tokens_s": sum(len(r.tokens) for r in results) / wall, "ttft_p50": statistics.median(ttft),
            "prefill_share": engine.seconds["prefill"] / sum(engine.seconds.values()),
            "passes": sum(len(r.steps) for r in results), "answers": [r.tokens for r in results]}


def drive(engine: BatchDecoder, submit_next) -> tuple[dict, dict, float]:
    """Steps ``engine`` until idle; ``submit_next(request, result)`` after each request
    ends. Returns first-token and submit times and the wall time."""
    first: dict = {}
    began = time.perf_counter()

    def saw(updates: list) -> None:
        for update in updates:
            if update.tokens and update.request not in first:
                first[update.request] = time.perf_counter()

    while engine.busy:
        rest = engine.step(early=saw)
        saw(rest)
        for update in rest:
            if update.done:
                submit_next(update.request)
    return first, time.perf_counter() - began


def sessions_run(variant: str, kept: int) -> dict:
    engine = engine_of(variant, 8, kept)
    waiting, pending, results, submitted = list(range(len(sessions))), {}, {}, {}

    def start(session: int, call: int) -> None:
        request = engine.submit(sessions[session][call].chat, max_new_tokens=256, scope="server")
        submitted[request] = time.perf_counter()
        pending[request] = (session, call)

    def submit_next(request: int) -> None:
        if request not in pending:
            return
        session, call = pending.pop(request)
        results[(session, call)] = engine.result(request)
        if call + 1 < 4:
            start(session, call + 1)
        elif waiting:
            start(waiting.pop(0), 0)

    for _ in range(8):
        start(waiting.pop(0), 0)
    first, wall = drive(engine, submit_next)
    return summary(engine, [results[key] for key in sorted(results)], wall, first, submitted)


def mix_run(variant: str) -> dict:
    engine = engine_of(variant, 8)
    submitted = {}
    for prompt in mix:
        submitted[engine.submit(prompt, max_new_tokens=256)] = time.perf_counter()
    first, wall = drive(engine, lambda request: None)
    return summary(engine, [engine.result(i) for i in submitted], wall, first, submitted)


passes = chunk_times()
loads = {"agent C=8, kept prefixes": lambda v: sessions_run(v, 512),
         "agent C=8, whole prompts": lambda v: sessions_run(v, 0)}
if prompts:
    loads["mix C=8"] = mix_run
records = []
for round_ in range(rounds):
    for load, run in loads.items():
        for variant in (("table", "model") if round_ % 2 == 0 else ("model", "table")):
            row = run(variant)
            records.append({"round": round_, "load": load, "variant": variant, **row})
            print(round_, load, variant, {k: (round(v, 3) if isinstance(v, float) else v)
                                          for k, v in row.items() if k != "answers"}, flush=True)
print("| prompt chunk | table kernel | model's layers | kernel |")
print("|---|---|---|---|")
for row in passes:
    print(f"| 512 after {row['cached']} | {row['table']:.0f} ms | {row['model']:.0f} ms | {row['kernel']} |")
print("| load | table tok/s | model tok/s | ratio (median) | TTFT p50 table / model (s) | "
      "prefill share table / model | same answers |")
print("|---|---|---|---|---|---|---|")
for load in loads:
    rows = {v: [r for r in records if r["load"] == load and r["variant"] == v] for v in ("table", "model")}
    ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(*rows.values()))
    med = {v: {key: statistics.median(r[key] for r in rs) for key in ("tokens_s", "ttft_p50", "prefill_share")}
           for v, rs in rows.items()}
    same = all(a["answers"] == b["answers"] for a, b in zip(*rows.values()))
    a, b = med["table"], med["model"]
    print(f"| {load} | {a['tokens_s']:.1f} | {b['tokens_s']:.1f} | {ratio:.3f} | {a['ttft_p50']:.2f} / "
          f"{b['ttft_p50']:.2f} | {100 * a['prefill_share']:.1f} % / {100 * b['prefill_share']:.1f} % | {same} |")
Path(__file__).with_name("compare.json").write_text(json.dumps(
    {"passes": passes, "loads": [{k: v for k, v in r.items() if k != "answers"} for r in records]}, indent=1) + "\n")
