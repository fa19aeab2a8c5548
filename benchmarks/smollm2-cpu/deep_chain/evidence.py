"""Agent sessions in process at C clients (eight sessions' four calls each, scope
"server", kept prefixes of 512 MiB, 256 tokens), once per method spec: tokens/s, tokens
and nodes per request per pass, the engine's time shares, and, per kind of drafted node
(the deep chain's by the bits of its match, retrieval, copy-logit), how many were
verified with their parent accepted and how many of those were accepted.

    .venv/bin/python benchmarks/smollm2-cpu/deep_chain/evidence.py racer,racer:deep=0 8
"""

import time, sys, collections, racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.drafting.racer import RacerDrafter
racer.use_threads(2)
model, tok = racer.load_model(dtype="float32")
agent = load_questions("agent_sessions", limit=32)
sessions = [agent[i:i+4] for i in range(0, 32, 4)]
stats = collections.defaultdict(lambda: [0, 0])
orig = RacerDrafter.observe
def observe(self, tree, topk, accepted):
    acc = set(accepted)
    for i in range(1, len(tree)):
        if tree.parents[i] in acc:
            f = tree.features[i] if tree.features else None
            key = f[0] if f else "none"
            if key == "context": key = ("context", f[1])
            stats[key][0] += 1; stats[key][1] += i in acc
    return orig(self, tree, topk, accepted)
RacerDrafter.observe = observe
clients = int(sys.argv[2])
for spec in sys.argv[1].split(","):
    stats.clear()
    engine = BatchDecoder(model, tok, spec, max_batch=clients, prefix_cache_mib=512)
    engine.generate_all(["Hello"], max_new_tokens=4)
    engine.seconds = dict.fromkeys(engine.seconds, 0.0)
    waiting = list(range(8)); pending = {}; tokens = passes = nodes = 0
    def start(s, c): pending[engine.submit(sessions[s][c].chat, max_new_tokens=256, scope="server")] = (s, c)
    for _ in range(clients): start(waiting.pop(0), 0)
    t = time.perf_counter(); npass = 0
    while engine.busy:
        ups = engine.step(); npass += 1
        for u in ups:
            if u.done and u.request in pending:
                s, c = pending.pop(u.request); r = engine.result(u.request)
                tokens += len(r.tokens); passes += len(r.steps); nodes += sum(st.tree_size for st in r.steps)
                if c + 1 < 4: start(s, c + 1)
                elif waiting: start(waiting.pop(0), 0)
    w = time.perf_counter() - t
    print(spec, "tok/s", round(tokens/w,1), "tok/pass", round(tokens/passes,2), "nodes/pass", round(nodes/passes,2), "engine steps", npass,
          {k: round(v/w,3) for k, v in engine.seconds.items()}, flush=True)
    for k, (n, a) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        print("   ", k, n, a, round(a/max(n,1),2))
