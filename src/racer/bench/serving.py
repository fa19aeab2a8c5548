"""``racer bench-serve``: a load generator for OpenAI-compatible servers.

C concurrent clients each send their share of the benchmark prompts (Spec-Bench and
HumanEval, chat), one after another, as streamed chat completions, greedy. Reported per
server and concurrency: completion tokens per second of the whole load, time to first
token and request latency (p50, p99). Each method runs in a ``racer serve`` process of
its own and, as the outside anchor, ``transformers serve --continuous-batching`` on
the same model folder; every server is started before the first load and the loads are
interleaved (at each C, every server in turn), so a machine that slows down slows all
of them alike. Talks to the servers over HTTP only: ``clients`` are the clients, ``servers`` the
processes, ``prometheus`` the metrics they expose; this module runs the loads and
reports them.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from racer.bench.clients import Load, merge_rounds, prompt_pool, run_load, same_answers, stream_chat
from racer.bench.prometheus import counters, nodes_per_pass, seconds_by_part, tokens_per_pass
from racer.bench.servers import (ServerProcess, free_port, racer_server, resident_mib, transformers_server,
                                 vllm_server, vllm_speculative_config)

@dataclass
class ServerSpec:
    """A server to measure: its name and how to start it on a port."""

    name: str
    start: Callable[[int], ServerProcess]


def bench_serve(methods: Sequence[str], concurrency: Sequence[int], max_tokens: int, per_client: int,
                anchor: bool, out: Path, model: str | None = None, dtype: str = "float32",
                threads: int | None = None, max_batch: int = 8, rounds: int = 1,
                ready_timeout: float = 900.0, vllm: str | None = None, vllm_methods: Sequence[str] = (),
                vllm_tokens: int = 5, vllm_racer_tokens: int = 16, fresh: bool = False,
                workload: str = "mix") -> list[Load]:
    """Run the interleaved loads (``rounds`` times over, each round every C and at each C
    every server in turn) against one ``racer serve`` per method, the anchor, and, with
    ``vllm`` (the Python of an environment with vLLM), one vLLM server per
    ``vllm_methods``; write ``serve.json`` and the plot into ``out``, print the table
    (against the first vLLM server if any, else the first server); returns the loads.
    Servers are started once and frozen while idle, or with ``fresh`` for each load.
    ``workload``: the prompts (``racer.bench.clients.prompt_pool``)."""
    from racer.loading import load_tokenizer, model_folder

    out.mkdir(parents=True, exist_ok=True)
    questions = prompt_pool(workload)
    tokenizer = load_tokenizer(model)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the anchor and vLLM take torch's threads from here
    name = model or "SmolLM2-135M-Instruct"
    specs = [ServerSpec(f"racer serve --method {m}",
                        lambda port, m=m: racer_server(m, port, model, dtype, threads, max_batch, out))
             for m in methods]
    if anchor:
        specs.append(ServerSpec("transformers serve --continuous-batching",
                                lambda port: transformers_server(port, model_folder(model), dtype, out)))
    for method in vllm_methods if vllm else ():
        vllm_speculative_config(method)  # a bad name fails before any server starts
        specs.append(ServerSpec(f"vllm {method}", lambda port, m=method: vllm_server(
            m, port, vllm, model_folder(model), name, dtype, threads, max_batch, vllm_tokens, out,
            vllm_racer_tokens)))
    baseline = next((s.name for s in specs if s.name.startswith("vllm ")), specs[0].name if specs else "")
    running: dict[str, ServerProcess] = {}
    failures: dict[str, str] = {}
    loads: list[Load] = []

    def start(spec: ServerSpec) -> ServerProcess | None:
        try:
            server = spec.start(free_port())
        except OSError as err:
            failures[spec.name] = f"could not start: {err}"
            return None
        try:
            server.wait_ready(ready_timeout)
        except RuntimeError as err:
            failures[spec.name] = str(err)
            server.stop()
            return None
        stream_chat("127.0.0.1", server.port, server.model, "Say hello.", 8, count)  # warm-up, not reported
        return server

    try:
        if not fresh:
            for spec in specs:
                server = start(spec)
                if server is not None:
                    server.pause()
                    running[spec.name] = server
        taken = 0
        for round_ in range(rounds):
            for c in concurrency:
                # Prompts no earlier load sent: a server whose drafters remember earlier
                # requests must not be handed the same questions again.
                prompts = [questions[(taken + k) % len(questions)] for k in range(c * per_client)]
                taken += c * per_client
                for spec in specs:
                    if spec.name in failures:
                        continue
                    server = running.get(spec.name) if not fresh else start(spec)
                    if server is None:
                        continue
                    server.resume()
                    try:
                        before = counters(server.port)
                        load = run_load(server.name, "127.0.0.1", server.port, server.model, prompts, c,
                                        max_tokens, count)
                        after = counters(server.port)
                        load.nodes = nodes_per_pass(before, after)
                        load.per_pass, load.accepted_length = tokens_per_pass(before, after)
                        load.seconds_by_part = seconds_by_part(before, after)
                    finally:
                        if fresh:
                            server.stop()
                        else:
                            server.pause()
                    loads.append(load)
                    print(f"  round {round_ + 1}, C={c}, {server.name}: {load.tokens_per_s:.1f} tok/s, "
                          f"{load.errors} errors", file=sys.stderr, flush=True)
    finally:
        for server in running.values():
            server.stop()
    report = {"settings": {"workload": workload, "methods": list(methods), "concurrency": list(concurrency), "max_tokens": max_tokens,
                           "per_client": per_client, "model": name, "dtype": dtype,
                           "threads": threads, "max_batch": max_batch, "rounds": rounds,
                           "vllm_methods": list(vllm_methods) if vllm else [], "vllm_tokens": vllm_tokens,
                           "vllm_racer_tokens": vllm_racer_tokens,
                           "vllm_speculative_configs": {m: vllm_speculative_config(m, vllm_tokens, vllm_racer_tokens)
                                                        for m in (vllm_methods if vllm else ())},
                           "fresh_servers": fresh},
              "failures": failures,
              "loads": [{"server": l.server, "concurrency": l.concurrency, "seconds": l.seconds, "nodes": l.nodes,
                         "per_pass": l.per_pass, "accepted_length": l.accepted_length,
                         "seconds_by_part": l.seconds_by_part,
                         "outcomes": [asdict(o) for o in l.outcomes]} for l in loads]}
    (out / "serve.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    merged = merge_rounds(loads)
    print(table(merged, baseline))
    if any(load.seconds_by_part for load in merged):
        print("\nWhere a racer server's time went (share of the load's wall time; engine and API are\n"
              "separate processes, so each side's shares add up to its own 100%):\n")
        print(breakdown(merged))
    for server_name, why in failures.items():
        print(f"\n{server_name}: not measured: {why}")
    if merged:
        plot(merged, out / "serve_throughput.png")
    return loads


def table(loads: Sequence[Load], baseline: str) -> str:
    """The markdown table: throughput (and against the baseline server), TTFT and latency."""
    same = same_answers(loads, baseline)
    def figure(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    label = baseline.removeprefix("racer serve --method ") if baseline else "baseline"
    lines = [f"| C | server | tokens/s | vs {label} | TTFT p50 / p99 (s) | latency p50 / p99 (s) | tokens/pass | "
             "vLLM accepted length | nodes/request/pass | same text as baseline | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for load in sorted(loads, key=lambda l: l.concurrency):  # stable: each C's servers in their order
        reference = next((l for l in loads if l.server == baseline and l.concurrency == load.concurrency), None)
        ratio = load.tokens_per_s / reference.tokens_per_s if reference and reference.tokens_per_s else float("nan")
        lines.append(f"| {load.concurrency} | {load.server} | {load.tokens_per_s:.1f} | {ratio:.2f}x | "
                     f"{load.percentile('ttft', 0.5):.2f} / {load.percentile('ttft', 0.99):.2f} | "
                     f"{load.percentile('latency', 0.5):.1f} / {load.percentile('latency', 0.99):.1f} | "
                     f"{figure(load.per_pass)} | {figure(load.accepted_length)} | {figure(load.nodes)} | "
                     f"{same.get((load.server, load.concurrency), '-')} | {load.errors} |")
    return "\n".join(lines)


ENGINE_PARTS = ("verify", "draft", "prefill", "emit", "finish", "hand_off")
API_PARTS = ("prepare", "detokenize", "respond")


def breakdown(loads: Sequence[Load]) -> str:
    """The markdown table of a racer server's seconds by part, as shares of each load's
    wall time: the engine core's (``idle/other``: waiting for work, its loop outside the
    parts, or its process descheduled) and the API side's work on requests."""
    lines = ["| C | server | " + " | ".join(ENGINE_PARTS) + " | idle/other | API: " + " | ".join(API_PARTS) + " |",
             "|---|---|" + "---|" * (len(ENGINE_PARTS) + 1 + len(API_PARTS))]
    for load in sorted(loads, key=lambda l: l.concurrency):
        parts = load.seconds_by_part
        if not parts or not load.seconds:
            continue
        share = lambda key: 100 * parts.get(key, 0.0) / load.seconds  # noqa: E731
        engine = [share(f"engine.{p}") for p in ENGINE_PARTS]
        other = max(100 - sum(engine), 0.0)
        lines.append(f"| {load.concurrency} | {load.server} | " + " | ".join(f"{v:.1f}%" for v in engine)
                     + f" | {other:.1f}% | " + " | ".join(f"{share(f'api.{p}'):.1f}%" for p in API_PARTS) + " |")
    return "\n".join(lines)


def plot(loads: Sequence[Load], path: Path) -> None:
    """Throughput against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(l.server for l in loads):
        points = sorted((l.concurrency, l.tokens_per_s) for l in loads if l.server == server)
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=server)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("completion tokens / s (whole load)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def server_memory(method: str, marks: Sequence[int], concurrency: int, max_tokens: int, out: Path,
                  model: str | None = None, dtype: str = "float32", threads: int | None = None,
                  max_batch: int = 8, memory_scope: str = "server") -> list[dict]:
    """One ``racer serve``: after each mark (requests answered), its resident memory and
    ``/metrics``' idle drafters. Every request a different prompt (a benchmark
    question's first 400 characters, numbered), so each drafter's memory keeps growing
    to its own bounds."""
    questions = [q[:400] for q in prompt_pool()]
    server = racer_server(method, free_port(), model, dtype, threads, max_batch, out,
                          ["--memory-scope", memory_scope])
    rows = []
    try:
        server.wait_ready(900)
        sent = 0
        for mark in marks:
            prompts = [f"{questions[i % len(questions)]} (request {i})" for i in range(sent, mark)]
            load = run_load(server.name, "127.0.0.1", server.port, server.model, prompts, concurrency, max_tokens)
            if load.errors:
                raise RuntimeError(f"{load.errors} requests failed: {next(o.error for o in load.outcomes if o.error)}")
            sent = mark
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            connection.request("GET", "/metrics")
            metrics = connection.getresponse().read().decode()
            idle = next((float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("racer_idle_drafters ")), float("nan"))
            rows.append({"requests": mark, "rss_mib": resident_mib(server.process.pid), "idle_drafters": idle})
            print(f"  after {mark} requests: {rows[-1]['rss_mib']:.0f} MiB resident, {idle:.0f} idle drafters",
                  file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows
