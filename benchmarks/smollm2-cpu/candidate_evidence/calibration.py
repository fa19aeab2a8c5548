"""How well the acceptance model's rates match what happens, at C = 8 on the mix: every
candidate node the drafters proposed in a drafting step, the rate the budget saw for it
(conditional on its parent), and whether it would have been accepted, which the
request's final greedy answer settles. Counted over nodes whose parent would have been
accepted, by rate bucket and by evidence key (source, first level), for the acceptance
model learning from every proposed candidate ("candidates") and from the verified nodes
only ("verified"). 8 Spec-Bench questions (one per category) and 8 HumanEval ones, all
submitted at once, 128 tokens, scope "server", float32, 2 threads.

    .venv/bin/python benchmarks/smollm2-cpu/candidate_evidence/calibration.py VARIANT
"""

import collections
import sys

import racer
from racer import BatchDecoder
from racer.bench.questions import load_questions
from racer.budget.batch import BatchBudget
from racer.engine.memory import DraftSession

variant = sys.argv[1]
if variant not in ("candidates", "verified"):
    raise SystemExit("VARIANT: candidates or verified")
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
mix = [q.chat for q in load_questions("spec_bench", limit=1)[:8] + load_questions("human_eval")[:8]]
engine = BatchDecoder(model, tokenizer, "racer", max_batch=8)
engine.generate_all(mix[:2], max_new_tokens=16)
engine = engine.fresh()
observe = DraftSession.observe
if variant == "verified":
    DraftSession.observe = lambda self, tree, topk, accepted, rated=True, candidates=None, truth=None: observe(
        self, tree, topk, accepted, rated)
records = []
select = BatchBudget.select


def recording(self, trees, acceptances, cached):
    rates = [model_.probabilities(tree) for tree, model_ in zip(trees, acceptances)]
    records.append([(r.id, len(r.result.tokens), tree, p) for r, tree, p in zip(engine._active, trees, rates)])
    return select(self, trees, acceptances, cached)


BatchBudget.select = recording
ids = [engine.submit(prompt, max_new_tokens=128, scope="server") for prompt in mix]
while engine.busy:
    engine.step()
answers = {i: engine.result(i).tokens for i in ids}
buckets = collections.defaultdict(lambda: [0, 0, 0.0])
keys = collections.defaultdict(lambda: [0, 0, 0.0])
for step in records:
    for request, emitted, tree, rates in step:
        truth = answers[request][emitted:]
        matched = [True] + [False] * (len(tree) - 1)
        for i in range(1, len(tree)):
            depth = tree.depths[i]
            if not matched[tree.parents[i]] or depth > len(truth):
                continue
            matched[i] = hit = truth[depth - 1] == tree.tokens[i]
            for table, key in ((buckets, min(int(rates[i] * 10), 9)), (keys, tree.features[i][:2])):
                table[key][0] += 1
                table[key][1] += hit
                table[key][2] += rates[i]
print(f"{variant}: rate bucket | nodes | rated (mean) | accepted")
for bucket in sorted(buckets):
    n, hits, rated = buckets[bucket]
    print(f"  {bucket / 10:.1f}-{(bucket + 1) / 10:.1f} | {n} | {rated / n:.2f} | {hits / n:.2f}")
print(f"{variant}: evidence key | nodes | rated (mean) | accepted")
for key, (n, hits, rated) in sorted(keys.items(), key=lambda item: -item[1][0])[:16]:
    print(f"  {key} | {n} | {rated / n:.2f} | {hits / n:.2f}")
