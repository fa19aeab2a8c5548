"""What limiting the copy-logit table's prompt rows to the last W positions costs in MAT
and saves in prefill: one racer Decoder per W, every question decoded by each W in
turn (interleaved), greedy, 1 thread. Writes prompt_window.json beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/serve_core/prompt_window.py [LIMIT [W,W,... [MAX_TOKENS]]]

LIMIT: questions per category (2); W: prompt windows, 0 for every position (0,256,64,16,1);
MAX_TOKENS: each answer's length (256).
"""

import json
import statistics
import sys
from pathlib import Path

import torch

import racer
from racer.bench.questions import load_questions

torch.set_num_threads(1)
limit = int(sys.argv[1]) if len(sys.argv) > 1 else 2
windows = [int(w) for w in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 256, 64, 16, 1]
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
model, tokenizer = racer.load_model()
decoders = {w: racer.Decoder(model, tokenizer, "racer", prompt_window=w) for w in windows}
questions = [q for d in ("spec_bench", "human_eval", "mgsm") for q in load_questions(d, limit)]
rows = {w: [] for w in windows}
for q in questions:
    reference = None
    for w in windows:
        r = decoders[w].generate([{"role": "user", "content": q.prompt}], chat=True, max_new_tokens=max_tokens)
        reference = reference or r.tokens
        assert r.tokens == reference, (q.key, w)  # lossless whatever the table holds
        rows[w].append({"key": q.key, "prompt": r.prompt_tokens, "tokens": len(r.tokens), "passes": r.passes,
                        "prefill_s": r.prefill_s, "wall_s": r.wall_s})
    print(q.key, {w: round(rows[w][-1]["tokens"] / rows[w][-1]["passes"], 2) for w in windows}, flush=True)
summary = {}
for w in windows:
    tokens = sum(r["tokens"] for r in rows[w])
    passes = sum(r["passes"] for r in rows[w])
    long = [r for r in rows[w] if r["prompt"] > w > 0] if w else []
    summary[w] = {"mat": tokens / passes, "prefill_s_median": statistics.median(r["prefill_s"] for r in rows[w]),
                  "prefill_s_total": sum(r["prefill_s"] for r in rows[w]),
                  "tokens_per_s": tokens / sum(r["wall_s"] for r in rows[w]),
                  "questions_with_longer_prompts": len(long)}
print(json.dumps(summary, indent=1))
Path(__file__).with_name("prompt_window.json").write_text(json.dumps({"questions": len(questions), "summary": summary,
                                                                    "rows": rows}, indent=1))
