"""One pass per step: a joining request's prompt chunks riding in the decoding rows'
pass ("ride": the engine's rule, every chunk but the prompt's last; with ``all`` as
the fourth argument, every chunk; ``rule``: the engine's) against every chunk in a pass of its own before
theirs ("apart", the engine with ``_rides`` answering no; the prompt is prefilled on its
row either way), in process, the two runs of each load alternating, ``ROUNDS`` times:

- agent sessions at C = 8 (eight sessions' four calls each, a session's next call
  submitted when its last one ends, scope "server"), with kept prefixes of 512 MiB
  (a call computes what is new since the last: 155-548 tokens) and without (every
  call's whole conversation, up to 1,900 tokens: up to four chunks);
- with ``PROMPTS`` > 0, a mix of ``PROMPTS`` Spec-Bench and ``PROMPTS`` HumanEval
  questions at C = 8, all submitted at once.

Every load: ``METHOD`` (default racer), 256 tokens at most, capacity auto, float32,
2 threads, prefill chunks of 512 tokens. Prints tokens/s, time to first token (p50),
the decoding rows' step time (p50, p99: the gap between a request's consecutive
updates) and whether every answer is the same under both; writes
``compare-METHOD.json`` beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/one_pass/compare.py ROUNDS PROMPTS [METHOD [all|rule [LOAD]]]
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions

rounds, prompts = (int(a) for a in sys.argv[1:3])
method = sys.argv[3] if len(sys.argv) > 3 else "racer"
every_chunk = len(sys.argv) > 4 and sys.argv[4] == "all"
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i : i + 4] for i in range(0, 32, 4)]
mix = ([q.chat for q in load_questions("spec_bench", limit=prompts) + load_questions("human_eval", limit=prompts)]
       if prompts else [])


class Apart(BatchDecoder):
    def _rides(self, chunk) -> bool:
        return False


class EveryChunk(BatchDecoder):
    def _rides(self, chunk) -> bool:
        return self.rows.packs and bool(self._active)


VARIANTS = {"ride": EveryChunk if every_chunk else BatchDecoder, "apart": Apart}


class Clock:
    """Each request's submit time, first-token time and the gaps between its updates."""

    def __init__(self) -> None:
        self.submitted, self.first, self.last, self.gaps = {}, {}, {}, []

    def submit(self, request: int) -> None:
        self.submitted[request] = time.perf_counter()

    def saw(self, updates: list) -> None:
        now = time.perf_counter()
        for update in updates:
            if not update.tokens:
                continue
            if update.request not in self.first:
                self.first[update.request] = now
            else:
                self.gaps.append(now - self.last[update.request])
            self.last[update.request] = now


def engine_of(variant: str, clients: int, kept: int = 512) -> BatchDecoder:
    engine = VARIANTS[variant](model, tokenizer, method, max_batch=clients, prefix_cache_mib=kept)
    engine.generate_all(["Hello"] * 2, max_new_tokens=4)
    return engine


def summary(engine: BatchDecoder, results: list, wall: float, clock: Clock) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    ttft = [clock.first[i] - clock.submitted[i] for i in clock.first]
    return {"tokens_s": tokens / wall, "ttft_p50": statistics.median(ttft),
            "gap_p50": float(np.percentile(clock.gaps, 50)), "gap_p99": float(np.percentile(clock.gaps, 99)),
            "prefill_share": engine.seconds["prefill"] / sum(engine.seconds.values()),
            "prompt_computed": sum(r.prompt_tokens - r.prompt_reused for r in results),
            "passes": sum(len(r.steps) for r in results),
            "answers": [r.tokens for r in results]}


def step(engine: BatchDecoder, clock: Clock) -> list:
    updates = []

    def early(first: list) -> None:
        clock.saw(first)
        updates.extend(first)

    rest = engine.step(early=early)
    clock.saw(rest)
    return updates + rest


def sessions_run(variant: str, clients: int, kept: int) -> dict:
    engine, clock = engine_of(variant, clients, kept), Clock()
    waiting = list(range(len(sessions)))
    pending, results = {}, {}

    def start(session: int, call: int) -> None:
        request = engine.submit(sessions[session][call].chat, max_new_tokens=256, scope="server")
        clock.submit(request)
        pending[request] = (session, call)

    for _ in range(clients):
        start(waiting.pop(0), 0)
    began = time.perf_counter()
    while engine.busy:
        for update in step(engine, clock):
            if update.done and update.request in pending:
                session, call = pending.pop(update.request)
                results[(session, call)] = engine.result(update.request)
                if call + 1 < 4:
                    start(session, call + 1)
                elif waiting:
                    start(waiting.pop(0), 0)
    wall = time.perf_counter() - began
    return summary(engine, [results[key] for key in sorted(results)], wall, clock)


def mix_run(variant: str, clients: int) -> dict:
    engine, clock = engine_of(variant, clients), Clock()
    ids = []
    for prompt in mix:
        ids.append(engine.submit(prompt, max_new_tokens=256))
        clock.submit(ids[-1])
    began = time.perf_counter()
    while engine.busy:
        step(engine, clock)
    wall = time.perf_counter() - began
    return summary(engine, [engine.result(i) for i in ids], wall, clock)


loads = {"agent C=8, kept prefixes": lambda v: sessions_run(v, 8, 512),
         "agent C=8, whole prompts": lambda v: sessions_run(v, 8, 0)}
if len(sys.argv) > 5:  # a subset: the loads whose names contain it
    loads = {name: run for name, run in loads.items() if sys.argv[5] in name}
if prompts:
    loads["mix C=8"] = lambda v: mix_run(v, 8)
records = []
for round_ in range(rounds):
    for load, run in loads.items():
        for variant in (VARIANTS if round_ % 2 == 0 else list(VARIANTS)[::-1]):
            row = run(variant)
            records.append({"round": round_, "load": load, "variant": variant, **row})
            print(round_, load, variant, {k: (round(v, 3) if isinstance(v, float) else v)
                                          for k, v in row.items() if k != "answers"}, flush=True)
print(f"{method}: | load | ride tok/s | apart tok/s | ratio (median) | TTFT p50 ride / apart (s) | "
      "step gap p50 ride / apart (s) | p99 ride / apart (s) | same answers |")
print("|---|---|---|---|---|---|---|---|")
for load in loads:
    rows = {v: [r for r in records if r["load"] == load and r["variant"] == v] for v in VARIANTS}
    ratio = statistics.median(a["tokens_s"] / b["tokens_s"] for a, b in zip(*rows.values()))
    med = {v: {key: statistics.median(r[key] for r in rs) for key in ("tokens_s", "ttft_p50", "gap_p50", "gap_p99")}
           for v, rs in rows.items()}
    same = all(a["answers"] == b["answers"] for a, b in zip(*rows.values()))
    a, b = med["ride"], med["apart"]
    print(f"| {load} | {a['tokens_s']:.1f} | {b['tokens_s']:.1f} | {ratio:.3f} | {a['ttft_p50']:.2f} / "
          f"{b['ttft_p50']:.2f} | {a['gap_p50']:.3f} / {b['gap_p50']:.3f} | {a['gap_p99']:.2f} / {b['gap_p99']:.2f} "
          f"| {same} |")
Path(__file__).with_name(f"compare-{method.replace(':', '_')}{'-all' if every_chunk else ''}"
                         f"{'-' + sys.argv[5].replace(' ', '_') if len(sys.argv) > 5 else ''}.json").write_text(
    json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in records], indent=1) + "\n")
