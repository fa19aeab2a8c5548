"""Agent sessions at C=8 in process: eight sessions' four calls each (a session's next
call submitted when its last one ends, scope "server", kept prefixes of 512 MiB, 256
tokens), with the draft budget choosing each tree (capacity auto) against a fixed
capacity of 8, alternating, twice each. Prints tokens/s, tokens accepted per request per
pass, nodes verified per request per pass, and the engine's time shares.

    .venv/bin/python benchmarks/smollm2-cpu/long_prompts/sessions_c8.py
"""

import sys, time
import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
racer.use_threads(2)
model, tok = racer.load_model(dtype="float32")
qs = load_questions("agent_sessions", limit=16)
sessions = [qs[i:i + 4] for i in range(0, 32, 4)][:8]
def run(spec, capacity):
    engine = BatchDecoder(model, tok, spec, max_batch=8, prefix_cache_mib=512, capacity=capacity)
    engine.generate_all(["Hello"], max_new_tokens=4)
    engine.seconds = dict.fromkeys(engine.seconds, 0.0)
    nxt = {}
    for s, calls in enumerate(sessions):
        nxt[engine.submit(calls[0].chat, max_new_tokens=256, scope="server")] = (s, 1)
    tokens = passes = nodes = 0
    t = time.perf_counter()
    while engine.busy:
        for u in engine.step():
            if u.done and u.request in nxt:
                s, k = nxt.pop(u.request)
                r = engine.result(u.request)
                tokens += len(r.tokens); passes += len(r.steps); nodes += sum(st.tree_size for st in r.steps)
                if k < 4:
                    nxt[engine.submit(sessions[s][k].chat, max_new_tokens=256, scope="server")] = (s, k + 1)
    w = time.perf_counter() - t
    print(spec, capacity, "tok/s", round(tokens / w, 1), "tokens/pass/request", round(tokens / passes, 2),
          "nodes/request/pass", round(nodes / passes, 2), {k: round(v / w, 3) for k, v in engine.seconds.items()}, flush=True)
for spec, cap in [("racer", None), ("racer", 8), ("racer", None), ("racer", 8)]:
    run(spec, cap)
