"""racer serve of two checkouts, interleaved: four servers (before/after x none/racer),
each load sent to every server in turn while the others are frozen (SIGSTOP).

    python serve_ab.py BEFORE_SRC AFTER_SRC OUT_FOLDER [ROUNDS]

BEFORE_SRC and AFTER_SRC are the ``src`` folders of two worktrees, run with this Python
(its venv has racer's dependencies); every server gets ``--max-batch 8 --threads 2``."""
import json, os, statistics, sys
from pathlib import Path
from racer.bench.clients import prompt_pool, run_load
from racer.bench.servers import ServerProcess, free_port
from racer.loading import load_tokenizer

PY = sys.executable
SRC = {"before": sys.argv[1], "after": sys.argv[2]}
out = Path(sys.argv[3]); out.mkdir(parents=True, exist_ok=True)
tok = load_tokenizer(None)
count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
servers = {}
for label, src in SRC.items():
    for method in ("none", "racer"):
        port = free_port()
        env = dict(os.environ, PYTHONPATH=src)
        cmd = [PY, "-m", "racer.cli", "serve", "--method", method, "--port", str(port), "--max-batch", "8",
               "--max-queue", "64", "--threads", "2"]
        servers[f"{label} {method}"] = ServerProcess(f"{label} {method}", cmd, port, "SmolLM2-135M-Instruct",
                                                     out / f"{label}-{method}.log", env)
try:
    for s in servers.values():
        s.wait_ready(900)
        s.pause()
    pool = prompt_pool()
    taken, rows = 0, []
    for rnd in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
        for c in (1, 4, 8):
            n = max(2 * c, 4)
            prompts = [pool[(taken + k) % len(pool)] for k in range(n)]
            taken += n
            order = list(servers) if rnd % 2 == 0 else list(reversed(list(servers)))
            for name in order:
                s = servers[name]
                s.resume()
                try:
                    load = run_load(name, "127.0.0.1", s.port, s.model, prompts, c, 256, count)
                finally:
                    s.pause()
                texts = [o.text for o in load.outcomes]
                rows.append({"round": rnd + 1, "C": c, "server": name, "tokens_per_s": load.tokens_per_s,
                             "ttft_p50": load.percentile("ttft", 0.5), "errors": load.errors, "texts": texts})
                print(f"round {rnd + 1} C={c} {name}: {load.tokens_per_s:.1f} tok/s, TTFT p50 "
                      f"{load.percentile('ttft', 0.5):.2f} s, {load.errors} errors", flush=True)
finally:
    for s in servers.values():
        s.stop()
json.dump(rows, open(out / "serve_ab.json", "w"))
for c in (1, 4, 8):
    for name in servers:
        rates = [r["tokens_per_s"] for r in rows if r["C"] == c and r["server"] == name]
        print(f"C={c} {name}: median {statistics.median(rates):.1f} tok/s over {len(rates)} rounds ({', '.join(f'{x:.1f}' for x in rates)})")
