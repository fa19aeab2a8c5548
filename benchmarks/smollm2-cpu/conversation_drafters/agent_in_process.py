"""``BatchDecoder`` with RACER, in process, under C agent sessions (``--workload agent``:
each session sends its calls in order, the next when the last one ends), set as
``racer serve`` sets it (``prefill_chunk`` 2048, a 512 MiB prefix cache, scope
``server``). Prints tokens/s, tokens emitted per verified pass, the seconds the drafters
spent learning prompts (``DrafterMemory.begin``), how many prompt windows RACER's
automata inserted, a hash of every answer (the same on every checkout: greedy), and the
engine's seconds by part.

    .venv/bin/python benchmarks/smollm2-cpu/conversation_drafters/agent_in_process.py C [CAPACITY [METHOD]]

CAPACITY (a number) fixes the tree size, which makes the run deterministic: its tokens
per pass then compare checkouts without the draft budget's timing in between (``auto``:
the draft budget, the default). METHOD: the engine's method (default ``racer``). Run from
two checkouts alternately (``PYTHONPATH=OTHER/src``) for a before/after.
"""

import hashlib
import sys
import time

import racer
from racer.bench.clients import prompt_pool
from racer.drafting.automaton import NgramAutomaton
from racer.engine.loop import BatchDecoder

concurrency = int(sys.argv[1])
capacity = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "auto" else None
method = sys.argv[3] if len(sys.argv) > 3 else "racer"
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
engine = BatchDecoder(model, tokenizer, method, capacity=capacity, max_batch=8, prefill_chunk=2048,
                      prefix_cache_mib=512)
engine.calibrate()

learning = {"seconds": 0.0, "windows": 0, "inside": False}
begin, insert = engine.memory.begin, NgramAutomaton.insert


def timed_begin(*args, **kwargs):
    start, learning["inside"] = time.perf_counter(), True
    try:
        return begin(*args, **kwargs)
    finally:
        learning["seconds"] += time.perf_counter() - start
        learning["inside"] = False


def counted_insert(self, window):
    learning["windows"] += learning["inside"]  # a prompt's windows, not the answers'
    return insert(self, window)


engine.memory.begin = timed_begin
NgramAutomaton.insert = counted_insert
queues = [list(session.requests) for session in prompt_pool("agent")[:concurrency]]
live, answers = {}, {}


def send(session):
    if queues[session]:
        live[engine.submit(queues[session].pop(0), max_new_tokens=256, scope="server")] = (session, len(queues[session]))


for session in range(concurrency):
    send(session)
passes = emitted = tokens = 0
start = time.perf_counter()
while engine.busy:
    for update in engine.step():
        if update.tree_size:
            passes, emitted = passes + 1, emitted + len(update.tokens)
        if update.done:
            key = live.pop(update.request)
            answers[key] = tuple(engine.result(update.request).tokens)
            tokens += len(answers[key])
            send(key[0])
seconds = time.perf_counter() - start
digest = hashlib.sha1(repr(sorted(answers.items())).encode()).hexdigest()[:10]
print(f"{seconds:.1f} s, {tokens / seconds:.1f} tokens/s, {emitted / passes:.3f} tokens per pass, answers {digest}; "
      f"drafters learning prompts {learning['seconds']:.2f} s, {learning['windows']} windows", flush=True)
print("engine seconds:", {part: round(s, 2) for part, s in engine.seconds.items()})
