"""C agent sessions on ``BatchDecoder`` in process, set as ``racer serve`` sets it (as
``../conversation_drafters/agent_in_process.py``), and the shape of its steps: the
share of request-passes that verified no draft (the root alone), the share whose whole
tree was accepted, nodes verified and candidates proposed per request-pass, and
histograms of accepted tokens and tree sizes.

    .venv/bin/python benchmarks/smollm2-cpu/host_standing/step_shapes.py C [METHOD]

Run it under ``farm-bench`` against another METHOD or environment for an A/B.
"""

import collections
import sys
import time

import racer
from racer.bench.clients import prompt_pool
from racer.engine.loop import BatchDecoder

concurrency = int(sys.argv[1])
method = sys.argv[2] if len(sys.argv) > 2 else "racer"
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
engine = BatchDecoder(model, tokenizer, method, max_batch=8, prefill_chunk=2048, prefix_cache_mib=512)
engine.calibrate()
queues = [list(session.requests) for session in prompt_pool("agent")[:concurrency]]
live = {}


def send(session):
    if queues[session]:
        live[engine.submit(queues[session].pop(0), max_new_tokens=256, scope="server")] = session


for session in range(concurrency):
    send(session)
start, steps, tokens = time.perf_counter(), [], 0
while engine.busy:
    for update in engine.step():
        if update.done:
            session = live.pop(update.request)
            result = engine.result(update.request)
            steps += result.steps
            tokens += len(result.tokens)
            send(session)
seconds = time.perf_counter() - start
count = len(steps)
print(f"C={concurrency} {method}: {seconds:.1f} s, {tokens / seconds:.1f} tokens/s; {count} request-passes, "
      f"{sum(1 + s.accepted for s in steps) / count:.2f} tokens per pass")
print("engine seconds", {part: round(value, 1) for part, value in engine.seconds.items()})
whole = [s for s in steps if s.tree_size > 1 and s.accepted == s.tree_size - 1]
print(f"no draft {sum(s.tree_size == 1 for s in steps) / count:.1%}; whole tree accepted {len(whole) / count:.1%}; "
      f"nodes per request-pass {sum(s.tree_size for s in steps) / count:.2f}; "
      f"candidates {sum(s.candidates for s in steps) / count:.1f}")
print("accepted", sorted(collections.Counter(s.accepted for s in steps).items()))
print("tree sizes", sorted(collections.Counter(s.tree_size for s in steps).items()))
