"""Batched tree passes of ``racer serve``'s engine with tree attention's two kernels for
a few queries a row: ``few_query_attention`` (the query heads sharing a KV head stacked
into one product with it) against torch's grouped SDPA kernel alone. Eight agent-session
prompts of 1,000-1,900 tokens are prefilled into a ``BatchDecoder`` of 8 rows, which then
decodes greedily; every pass of the load is run three times with each kernel,
alternating, on the same trees (the same positions are written again), and each
kernel's fastest of three is kept. Prints the median ms per pass of each, the median
per-pass ratio, and how many node argmaxes differ between the two.

    .venv/bin/python benchmarks/smollm2-cpu/attention/batched_passes.py
"""

import statistics
import time

import racer
import racer.fastpaths.attention as attention
from racer import BatchDecoder
from racer.bench.questions import load_questions

racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
prompts = [q.chat for q in load_questions("agent_sessions", limit=8)][3::4][:8]  # each session's last call
engine = BatchDecoder(model, tokenizer, "racer", max_batch=8)
for prompt in prompts:
    engine.submit(prompt, max_new_tokens=120)
while engine.waiting:
    engine.step()
few = attention.FEW_QUERIES
forward = engine.rows.forward
best: dict[int, list[float]] = {few: [], 0: []}
flips = 0


def timed(trees, *rest):
    global flips
    fastest, logits = {few: float("inf"), 0: float("inf")}, {}
    for queries in [0, few] * 3:
        attention.FEW_QUERIES = queries
        start = time.perf_counter()
        logits[queries] = forward(trees, *rest)
        fastest[queries] = min(fastest[queries], time.perf_counter() - start)
    attention.FEW_QUERIES = few
    for queries, seconds in fastest.items():
        best[queries].append(seconds)
    flips += int((logits[few].argmax(-1) != logits[0].argmax(-1)).sum())
    return logits[few]


engine.rows.forward = timed
while engine.busy:
    engine.step()
print(f"{len(best[0])} batched passes; ms per pass (median): few-query products "
      f"{1000 * statistics.median(best[few]):.1f}, grouped SDPA {1000 * statistics.median(best[0]):.1f}; "
      f"median ratio {statistics.median(a / b for a, b in zip(best[few], best[0])):.3f}; argmax differs on {flips} nodes")
