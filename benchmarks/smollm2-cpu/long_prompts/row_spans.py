"""Batched tree passes over rows of very different lengths, each row attended over its
own span (``few_query_attention`` with the rows' spans) against every row padded to
the longest. Four agent sessions' first calls (about 250 tokens) and four others' last
calls (1,000-1,900) are prefilled into a ``BatchDecoder`` of 8 rows, which then decodes
greedily; every pass of the load is run three times each way, alternating, on the same
trees, and each way's fastest of three is kept. Prints the median ms per pass of each,
the median per-pass ratio, the largest logit difference and how many node argmaxes
differ.

    .venv/bin/python benchmarks/smollm2-cpu/long_prompts/row_spans.py
"""

import statistics
import time

import racer
import racer.fastpaths.attention as attention
from racer import BatchDecoder
from racer.bench.questions import load_questions

racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
calls = [q.chat for q in load_questions("agent_sessions", limit=16)]
prompts = calls[0::4][:4] + calls[3::4][4:8]
engine = BatchDecoder(model, tokenizer, "racer", max_batch=8)
for prompt in prompts:
    engine.submit(prompt, max_new_tokens=60)
while engine.waiting:
    engine.step()
print("row lengths at the first pass:", engine.rows.lengths)
share = attention.PADDED_SHARE
forward = engine.rows.forward
best: dict[str, list[float]] = {"spans": [], "padded": []}
flips, largest = 0, 0.0


def timed(trees, *rest):
    global flips, largest
    fastest, logits = {"spans": float("inf"), "padded": float("inf")}, {}
    for way in ["padded", "spans"] * 3:
        attention.PADDED_SHARE = share if way == "spans" else 1.0  # 1.0: never row by row
        start = time.perf_counter()
        logits[way] = forward(trees, *rest)
        fastest[way] = min(fastest[way], time.perf_counter() - start)
    attention.PADDED_SHARE = share
    for way, seconds in fastest.items():
        best[way].append(seconds)
    flips += int((logits["spans"].argmax(-1) != logits["padded"].argmax(-1)).sum())
    largest = max(largest, float((logits["spans"] - logits["padded"]).abs().max()))
    return logits["spans"]


engine.rows.forward = timed
while engine.busy:
    engine.step()
print(f"{len(best['spans'])} batched passes; ms per pass (median): row spans {1000 * statistics.median(best['spans']):.1f}, "
      f"padded {1000 * statistics.median(best['padded']):.1f}; median ratio "
      f"{statistics.median(a / b for a, b in zip(best['spans'], best['padded'])):.3f}; largest logit difference "
      f"{largest:.1e}; argmax differs on {flips} nodes")
