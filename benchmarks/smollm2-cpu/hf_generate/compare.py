"""``model.generate(..., custom_generate=racer.hf.generate)`` against ``racer.Decoder`` (what
``racer generate`` runs) and plain ``generate``, on the same prompts: greedy, float32, one
prompt at a time; per prompt the three run back to back in a rotating order. Per way:
ms per new token (summed wall over summed tokens), the speedup over plain ``generate``
(summed wall), the median of the per-prompt ratios, and whether every output equals
plain ``generate``'s. Writes compare.json beside this file.

    .venv/bin/python benchmarks/smollm2-cpu/hf_generate/compare.py [METHOD [LIMIT [MAX_TOKENS]]]

METHOD: racer's method (racer); LIMIT: questions per Spec-Bench category, HumanEval and
MGSM (1); MAX_TOKENS (256).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

import racer
import racer.hf
from racer.bench.questions import load_questions

method = sys.argv[1] if len(sys.argv) > 1 else "racer"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
racer.use_threads(2)
model, tokenizer = racer.load_model(dtype="float32")
decoder = racer.Decoder(model, tokenizer, method)
questions = [q for name in ("spec_bench", "human_eval", "mgsm") for q in load_questions(name, limit=limit)]
greedy = dict(do_sample=False, top_p=None, top_k=None, temperature=None, max_new_tokens=max_tokens)


def hf(ids):
    tensor = torch.tensor([ids])
    return model.generate(tensor, attention_mask=torch.ones_like(tensor), **greedy)[0, len(ids):].tolist()


def hf_racer(ids):
    tensor = torch.tensor([ids])
    return model.generate(tensor, attention_mask=torch.ones_like(tensor), custom_generate=racer.hf.generate,
                          racer_method=method, **greedy)[0, len(ids):].tolist()


def decode(ids):
    # Decoder stops at the model's and the tokenizer's end tokens; generate at the
    # generation config's: the same here (checked by the identical column).
    return decoder.generate(ids, max_new_tokens=max_tokens).tokens


ways = {"generate": hf, "generate+racer.hf": hf_racer, "racer.Decoder": decode}
decode(racer.encode_prompt(tokenizer, questions[0].chat))  # calibration and first-use costs out of the timing
hf_racer(racer.encode_prompt(tokenizer, questions[0].chat))
rows = []
with torch.inference_mode():
    for index, question in enumerate(questions):
        ids = racer.encode_prompt(tokenizer, question.chat)
        names = list(ways)
        names = names[index % 3:] + names[: index % 3]
        row = {"question": question.question_id, "dataset": question.dataset}
        for name in names:
            start = time.perf_counter()
            tokens = ways[name](ids)
            row[name] = {"s": time.perf_counter() - start, "tokens": tokens}
        rows.append(row)
        print(question.question_id, {n: round(row[n]["s"], 2) for n in ways}, flush=True)

summary = {}
for name in ways:
    wall = sum(r[name]["s"] for r in rows)
    tokens = sum(len(r[name]["tokens"]) for r in rows)
    summary[name] = {
        "ms_per_token": 1000 * wall / tokens,
        "speedup": sum(r["generate"]["s"] for r in rows) / wall,
        "median_ratio": statistics.median(r["generate"]["s"] / r[name]["s"] for r in rows),
        "identical": sum(r[name]["tokens"] == r["generate"]["tokens"] for r in rows),
    }
print(f"| way | ms/token | speedup | median | identical |\n|---|---|---|---|---|")
for name, s in summary.items():
    print(f"| {name} | {s['ms_per_token']:.1f} | {s['speedup']:.2f}x | {s['median_ratio']:.2f}x | "
          f"{s['identical']}/{len(rows)} |")
out = Path(__file__).with_name("compare.json")
out.write_text(json.dumps({"method": method, "limit": limit, "max_tokens": max_tokens, "summary": summary,
                           "rows": rows}, indent=1))
