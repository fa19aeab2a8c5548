"""racer serve of two checkouts, interleaved, beside the same load decoded in process:
four servers (before/after x none/racer), each load sent to every server in turn while
the others are frozen (SIGSTOP), then decoded by an in-process BatchDecoder of each
method (C requests in flight, the next submitted as one ends: what C clients that
send one request after another give an engine, with no HTTP). The servers' time
breakdown (bench.prometheus.seconds_by_part) is kept where a server has one.

    python serve_ab.py BEFORE_SRC AFTER_SRC OUT_FOLDER [ROUNDS [C,C,... [MAX_TOKENS]]]

BEFORE_SRC and AFTER_SRC are the ``src`` folders of two worktrees, run with this Python
(its venv has racer's dependencies); every server gets ``--max-batch 8 --threads 2``,
the in-process engines 2 threads, and this process's racer is AFTER_SRC's."""
import json, os, statistics, sys, time
from pathlib import Path

sys.path.insert(0, sys.argv[2])
import torch
import racer
from racer.bench.clients import prompt_pool, run_load
from racer.bench.prometheus import counters, seconds_by_part
from racer.bench.servers import ServerProcess, free_port

PY = sys.executable
SRC = {"before": sys.argv[1], "after": sys.argv[2]}
out = Path(sys.argv[3]); out.mkdir(parents=True, exist_ok=True)
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
CONCURRENCY = tuple(int(c) for c in sys.argv[5].split(",")) if len(sys.argv) > 5 else (1, 4, 8)
MAX_TOKENS = int(sys.argv[6]) if len(sys.argv) > 6 else 256
tok = racer.load_tokenizer(None)
count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def in_process(engine, prompts, c):
    """tokens/s and TTFT p50 of ``prompts`` decoded with at most ``c`` in flight."""
    pending = list(prompts)
    submitted, first, tokens = {}, {}, 0
    start = time.perf_counter()
    def submit():
        messages = [{"role": "user", "content": pending.pop(0)}]
        submitted[engine.submit(messages, chat=True, max_new_tokens=MAX_TOKENS)] = time.perf_counter()
    while pending and len(submitted) < c:
        submit()
    while engine.busy:
        for update in engine.step():
            if update.tokens and update.request not in first:
                first[update.request] = time.perf_counter() - submitted[update.request]
            if update.done:
                tokens += len(engine.result(update.request).tokens)
                if pending:
                    submit()
    return tokens / (time.perf_counter() - start), statistics.median(first.values())


servers = {}
for label, src in SRC.items():
    for method in ("none", "racer"):
        port = free_port()
        env = dict(os.environ, PYTHONPATH=src)
        cmd = [PY, "-m", "racer.cli", "serve", "--method", method, "--port", str(port), "--max-batch", "8",
               "--max-queue", "64", "--threads", "2"]
        servers[f"{label} {method}"] = ServerProcess(f"{label} {method}", cmd, port, "SmolLM2-135M-Instruct",
                                                     out / f"{label}-{method}.log", env)
rows = []
try:
    for s in servers.values():
        s.wait_ready(900)
        s.pause()
    torch.set_num_threads(2)
    model, _ = racer.load_model(None)
    engines = {}
    for method in ("none", "racer"):
        engines[f"in-process {method}"] = racer.BatchDecoder(model, tok, method, max_batch=8)
        engines[f"in-process {method}"].calibrate()
    pool = prompt_pool()
    taken = 0
    for rnd in range(ROUNDS):
        for c in CONCURRENCY:
            n = max(c, 4)
            prompts = [pool[(taken + k) % len(pool)] for k in range(n)]
            taken += n
            order = list(servers) + list(engines)
            order = order if rnd % 2 == 0 else order[::-1]
            for name in order:
                if name in engines:
                    rate, ttft = in_process(engines[name], prompts, c)
                    rows.append({"round": rnd + 1, "C": c, "server": name, "tokens_per_s": rate, "ttft_p50": ttft,
                                 "errors": 0})
                    print(f"round {rnd + 1} C={c} {name}: {rate:.1f} tok/s, TTFT p50 {ttft:.2f} s", flush=True)
                    continue
                s = servers[name]
                s.resume()
                try:
                    before = counters(s.port)
                    load = run_load(name, "127.0.0.1", s.port, s.model, prompts, c, MAX_TOKENS, count)
                    parts = seconds_by_part(before, counters(s.port))
                finally:
                    s.pause()
                rows.append({"round": rnd + 1, "C": c, "server": name, "tokens_per_s": load.tokens_per_s,
                             "ttft_p50": load.percentile("ttft", 0.5), "latency_p99": load.percentile("latency", 0.99),
                             "errors": load.errors, "seconds": load.seconds, "seconds_by_part": parts,
                             "texts": [o.text for o in load.outcomes]})
                print(f"round {rnd + 1} C={c} {name}: {load.tokens_per_s:.1f} tok/s, TTFT p50 "
                      f"{load.percentile('ttft', 0.5):.2f} s, {load.errors} errors", flush=True)
finally:
    for s in servers.values():
        s.stop()
json.dump(rows, open(out / "serve_ab.json", "w"), indent=1)
names = list(servers) + ["in-process none", "in-process racer"]
print("| C | " + " | ".join(names) + " |")
print("|---|" + "---|" * len(names))
for c in CONCURRENCY:
    cells = []
    for name in names:
        mine = [r for r in rows if r["C"] == c and r["server"] == name]
        cells.append(f"{statistics.median(r['tokens_per_s'] for r in mine):.1f} "
                     f"({statistics.median(r['ttft_p50'] for r in mine):.2f} s)")
    print(f"| {c} | " + " | ".join(cells) + " |")
same = all(a["texts"] == b["texts"] for a in rows for b in rows
           if "texts" in a and "texts" in b and a["C"] == b["C"] and a["round"] == b["round"])
print(f"every server gave the same texts for the same load: {same}")
