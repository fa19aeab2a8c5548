"""At C=1: racer serve against racer generate (a Decoder in this process) on the same
prompts, alternating, the server frozen while the in-process decoder runs.

    python serve_vs_generate.py OUT_FOLDER"""
import os, statistics, sys, time, torch
from pathlib import Path
import racer
from racer.bench.clients import prompt_pool, run_load
from racer.bench.servers import ServerProcess, free_port

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
port = free_port()
cmd = [sys.executable, "-m", "racer.cli", "serve", "--method", "racer", "--port", str(port), "--max-batch", "8",
       "--threads", "2"]
server = ServerProcess("racer serve", cmd, port, "SmolLM2-135M-Instruct", out / "server.log", dict(os.environ))
torch.set_num_threads(2)
model, tok = racer.load_model()
count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
pool = prompt_pool()
groups = [pool[0:4], pool[28:32], pool[60:64]]
rows = []
try:
    server.wait_ready(900)
    server.pause()
    for rnd in range(2):
        for g, prompts in enumerate(groups):
            server.resume()
            load = run_load("serve", "127.0.0.1", port, "SmolLM2-135M-Instruct", prompts, 1, 256, count)
            server.pause()
            decoder = racer.Decoder(model, tok, "racer")
            decoder.calibrate(announce=None)
            start, tokens = time.perf_counter(), 0
            for p in prompts:
                tokens += len(decoder.generate([{"role": "user", "content": p}], max_new_tokens=256).tokens)
            gen = tokens / (time.perf_counter() - start)
            rows.append((load.tokens_per_s, gen))
            print(f"round {rnd + 1} group {g + 1}: racer serve {load.tokens_per_s:.1f} tok/s, racer generate "
                  f"{gen:.1f} tok/s, ratio {load.tokens_per_s / gen:.2f}", flush=True)
finally:
    server.stop()
ratios = [s / g for s, g in rows]
print(f"median ratio serve/generate {statistics.median(ratios):.2f} over {len(ratios)} pairs; "
      f"sums {sum(s for s, _ in rows):.1f} / {sum(g for _, g in rows):.1f}")
