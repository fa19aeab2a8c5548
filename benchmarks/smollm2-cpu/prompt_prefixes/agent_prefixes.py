"""One racer serve under C agent sessions (``--workload agent``: each client sends one
session's calls in order): tokens/s, time to first token (p50, p90, max and every
session's first call), and from the server's ``/metrics`` the prompt tokens, those a
kept prefix gave and the engine's seconds by part.

    .venv/bin/python benchmarks/smollm2-cpu/prompt_prefixes/agent_prefixes.py METHOD C [SERVE_ARG ...]

Run from two checkouts alternately (``PYTHONPATH=OTHER/src`` for the other one), or with
two sets of ``racer serve`` arguments, for a before/after; the server is started fresh
for each run.
"""

import re
import sys
import tempfile
import urllib.request
from pathlib import Path

from racer.bench.clients import prompt_pool, run_load
from racer.bench.servers import free_port, racer_server

method, concurrency = sys.argv[1], int(sys.argv[2])
port = free_port()
server = racer_server(method, port, None, "float32", 2, 8, Path(tempfile.mkdtemp()), sys.argv[3:])
server.wait_ready(300)
try:
    sessions = prompt_pool("agent")[:concurrency]
    load = run_load(method, "127.0.0.1", port, "SmolLM2-135M-Instruct", sessions, concurrency, 256)
    calls = len(load.outcomes) // concurrency
    firsts = sorted(round(o.ttft, 2) for o in load.outcomes[::calls])
    print(f"{load.seconds:.1f} s, {load.tokens_per_s:.1f} tokens/s, errors {load.errors}; TTFT p50 "
          f"{load.percentile('ttft', 0.5):.2f}, p90 {load.percentile('ttft', 0.9):.2f}, max "
          f"{load.percentile('ttft', 1.0):.2f} s; first calls' TTFT {firsts}")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in metrics.splitlines():
        if re.match(r"racer_(prompt_tokens(_cached)?_total|engine_seconds_total)", line):
            print(line)
finally:
    server.stop()
