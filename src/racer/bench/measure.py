"""Timings of the engine's parts and 16-bit agreement, for the figures in the docs. The
one module of the benchmark that reaches inside the engine: its job is timing parts of
a step that the public API does not expose.

    racer measure costs
    racer measure agreement --dtype bfloat16 --methods none,pld,racer:capacity=16
    racer measure kernels --threads 2
    racer measure attention --threads 2
    racer measure runs --threads 2
    racer measure evidence --dataset human_eval --limit 10 --tokens 256 --threads 2
    racer measure append --threads 2
    racer measure selftest --threads 2
    racer measure batch --threads 2 --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np
import torch

import racer
from racer.bench.questions import load_questions
from racer.budget import DraftBudget, evidence_levels
from racer.drafting.tree import DraftTree, chain
from racer.engine import ModelFacts, encode_prompt
from racer.engine.sampling import accept_greedy
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import KERNEL_LABELS, KERNELS
from racer.fastpaths.kernels import packed_weights


def costs(threads: int) -> None:
    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    rng = np.random.default_rng(0)
    verifier = TreeVerifier(model)
    for size in (16, 64):
        tree = random_tree(rng, verifier.facts.vocab_size, size, 8)
        verifier.prefill(rng.integers(1000, size=300).tolist())
        mask_us, commit_us = [], []
        for _ in range(50):
            t = time.perf_counter()
            verifier.tree_mask(tree)
            mask_us.append((time.perf_counter() - t) * 1e6)
            verifier.verify(tree)
            path = tree.path_to(len(tree) - 1)  # a path that is not a prefix: a real copy
            t = time.perf_counter()
            verifier.commit(path, len(tree))
            commit_us.append((time.perf_counter() - t) * 1e6)
        print(f"tree {size} nodes, cache 300 -> {verifier.cached} tokens: mask {statistics.median(mask_us):.0f} us, "
              f"compaction (path of {len(path)}) {statistics.median(commit_us):.0f} us (medians of 50)")


def kernels(threads: int, repeats: int = 7) -> None:
    """Tree passes with each linear kernel (``racer.fastpaths.KERNELS``): median wall time
    per size (the kernels interleaved, a fresh random tree each time, cache of 200
    tokens), and against the model's own layers the largest logit difference and how
    many nodes' argmax differ."""
    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    rng = np.random.default_rng(0)
    verifier = TreeVerifier(model)
    vocab = verifier.facts.vocab_size
    verifier.prefill(rng.integers(vocab, size=200).tolist())
    offered = [k for k in KERNELS if verifier.kernels.available(k)]
    print(f"{threads} threads; ms per pass, median of {repeats}; cache 200 tokens; x: against one stock node")
    base = None
    for size in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        seconds: dict[str, list[float]] = {k: [] for k in offered}
        diff, flips, nodes = 0.0, 0, 0
        for _ in range(repeats):
            tree = random_tree(rng, vocab, size, max(1, min(size - 1, 8)))
            logits = {}
            for kernel in offered:
                verifier.use_kernel(kernel)
                start = time.perf_counter()
                logits[kernel] = verifier.verify(tree)
                seconds[kernel].append(time.perf_counter() - start)
                verifier.commit([], size)
            for kernel in offered[1:]:
                diff = max(diff, float((logits[kernel] - logits["model"]).abs().max()))
                flips += int((logits[kernel].argmax(-1) != logits["model"].argmax(-1)).sum())
            nodes += size
        ms = {k: 1000 * statistics.median(v) for k, v in seconds.items()}
        base = base or ms["model"]
        row = "   ".join(f"{KERNEL_LABELS[k]} {v:6.1f} ({v / base:.2f}x)" for k, v in ms.items())
        print(f"{size:>3} nodes: {row}   max |logit diff| {diff:.1e}, argmax differs on {flips}/{nodes} node-kernels")


def attention(threads: int, repeats: int = 11, cached: tuple[int, ...] = (500, 1500)) -> None:
    """Tree passes with the stock SDPA path (the cache's KV heads repeated for the mask),
    with tree attention's grouped SDPA kernel alone, and with tree attention as it runs
    (a few queries a row: ``few_query_attention``'s stacked products), interleaved on the
    same random trees and chains after caches of ``cached`` tokens: median ms per pass
    and the largest logit difference from the stock path."""
    from racer.fastpaths import attention as tree_attention

    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    rng = np.random.default_rng(0)
    few = tree_attention.FEW_QUERIES
    print(f"{threads} threads; ms per pass, median of {repeats}; {model.config.num_attention_heads} query heads, "
          f"{model.config.num_key_value_heads} KV heads")
    for length in cached:
        verifier = TreeVerifier(model)
        vocab = verifier.facts.vocab_size
        grouped = verifier.tree_attention
        if grouped is None:
            print("tree attention does not apply to this model")
            return
        verifier.use_kernel("packed" if packed_weights(model) is not None else "model")
        verifier.prefill(rng.integers(vocab, size=length).tolist())
        for shape in ("tree", "chain"):
            for size in (2, 4, 8, 12, 16, 32):
                variants = {"stock": (None, few), "grouped SDPA": (grouped, 0), "tree attention": (grouped, few)}
                seconds: dict[str, list[float]] = {name: [] for name in variants}
                diff = 0.0
                for _ in range(repeats):
                    tree = (random_tree(rng, vocab, size, max(1, min(size - 1, 6))) if shape == "tree"
                            else chain(int(rng.integers(vocab)), rng.integers(vocab, size=size - 1).tolist()))
                    logits = []
                    for name, (switch, queries) in variants.items():
                        verifier.tree_attention, tree_attention.FEW_QUERIES = switch, queries
                        start = time.perf_counter()
                        logits.append(verifier.verify(tree))
                        seconds[name].append(time.perf_counter() - start)
                        verifier.commit([], size)
                    diff = max(diff, *(float((logits[0] - other).abs().max()) for other in logits[1:]))
                tree_attention.FEW_QUERIES = few
                ms = {name: 1000 * statistics.median(v) for name, v in seconds.items()}
                print(f"cache {length:>5}, {shape:>5} of {size:>2}: "
                      + "   ".join(f"{name} {v:6.1f} ({v / ms['stock']:.2f}x)" for name, v in ms.items())
                      + f"   max |logit diff| {diff:.1e}")


def runs(threads: int, repeats: int = 41) -> None:
    """One layer's attention of a packed pass of 8 tree rows, as the model's heads shape it,
    three ways: every row on its own, every row in one padded call, and the runs that
    ``padded_groups`` picks (its cost model's choice): median microseconds, for rows of
    alike and unlike context lengths and tree sizes. Where "picked" is not the fastest
    of the three, ``CALL_KEYS`` is off for this machine."""
    from racer.fastpaths.attention import _grouped_products, padded_groups

    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    print(f"{threads} threads; microseconds per layer, median of {repeats}; {heads} query heads, {kv_heads} KV heads")
    loads = {"alike, 300": [300] * 8, "100..800": list(range(100, 801, 100)), "500..4000": list(range(500, 4001, 500)),
             "alike, 3000": [3000] * 8, "7 x 200, 1 x 3000": [200] * 7 + [3000]}
    with torch.inference_mode():
        for nodes in (1, 4, 8):
            for name, lengths in loads.items():
                count, span = len(lengths), max(lengths) + nodes
                keys, values = torch.randn(count, kv_heads, span, dim), torch.randn(count, kv_heads, span, dim)
                query = torch.randn(1, heads, count * nodes, dim)
                spans = [length + nodes for length in lengths]

                def attend(split: list[tuple[int, int]]) -> None:
                    for first, end in split:
                        longest = max(spans[first:end])
                        mask = torch.zeros(end - first, 1, nodes, longest)
                        for row in range(first, end):
                            mask[row - first, :, :, spans[row]:] = torch.finfo(mask.dtype).min
                        queries = query[0, :, first * nodes : end * nodes].reshape(heads, end - first, nodes, dim)
                        _grouped_products(queries.transpose(0, 1), keys[first:end, :, :longest],
                                          values[first:end, :, :longest], mask, None)

                splits = {"row by row": [(row, row + 1) for row in range(count)], "one call": [(0, count)],
                          "picked": padded_groups(list(range(count)), [nodes] * count, spans)}
                seconds: dict[str, list[float]] = {way: [] for way in splits}
                for _ in range(repeats):
                    for way, split in splits.items():
                        start = time.perf_counter()
                        attend(split)
                        seconds[way].append(time.perf_counter() - start)
                us = {way: 1e6 * statistics.median(v) for way, v in seconds.items()}
                print(f"{nodes} nodes, contexts {name:>18}: " + "   ".join(f"{way} {v:7.0f}" for way, v in us.items())
                      + f"   picked {len(splits['picked'])} call(s)")


def append(threads: int, cached: int = 400, size: int = 6, repeats: int = 300) -> None:
    """What appending one tree pass's KV to every layer's cache costs: Hugging Face's
    DynamicCache (a torch.cat of the whole cache per layer) against racer.fastpaths.kvcache's
    in-place layers, beside a whole tree pass of that size on that cache."""
    from transformers import DynamicCache

    from racer.fastpaths.kvcache import growing_cache

    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    kv = [torch.randn(1, heads, cached, dim) for _ in range(2)]
    new = [torch.randn(1, heads, size, dim) for _ in range(2)]
    layers = range(config.num_hidden_layers)
    timings = {}
    for name, cache in (("DynamicCache (torch.cat)", DynamicCache(config=config)),
                        ("racer.fastpaths.kvcache (in place)", growing_cache(config))):
        for layer in layers:
            cache.update(*kv, layer)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                cache.update(*new, layer)
            samples.append(time.perf_counter() - start)
            cache.crop(-size)
        timings[name] = statistics.median(samples) * 1e3
    rng = np.random.default_rng(0)
    verifier = TreeVerifier(model)
    verifier.prefill(rng.integers(1000, size=cached).tolist())
    passes = []
    for _ in range(15):
        tree = random_tree(rng, verifier.facts.vocab_size, size, 4)
        start = time.perf_counter()
        verifier.verify(tree)
        passes.append(time.perf_counter() - start)
        verifier.commit([], size)
    whole = statistics.median(passes) * 1e3
    print(f"appending {size} positions to {config.num_hidden_layers} layers' KV at {cached} cached tokens "
          f"(median of {repeats}); a {size}-node tree pass there: {whole:.1f} ms (median of 15)")
    for name, ms in timings.items():
        print(f"  {name}: {ms:.2f} ms ({ms / whole:.1%} of the pass)")


def _followed(tree: DraftTree, truth: list[int]) -> list[int]:
    """The nodes of ``tree`` on the path the model took (root first): greedy acceptance
    with the model's actual next token at each depth as every node's argmax."""
    return accept_greedy(tree, [truth[d] if d < len(truth) else -1 for d in tree.depths])


def evidence(dataset: str, limit: int, tokens: int, threads: int, method: str = "racer") -> None:
    """How often the candidate nodes of a capacity=auto drafter are right, by evidence
    key (every level the draft budget learns at): over the whole candidate tree, not
    only the part the budget verified, a node whose parent lies on the path the model
    took is a try, and a hit if it is the model's next token there."""
    torch.set_num_threads(threads)
    model, tok = racer.load_model()
    decoder = racer.Decoder(model, tok, method)
    decoder.calibrate()
    if not isinstance(decoder.budget, DraftBudget):
        raise SystemExit(f"{method}: expected a drafter with capacity=auto")
    steps: list[tuple[DraftTree, DraftTree]] = []
    select = decoder.budget.select

    def recording(trees: list[DraftTree], acceptances: list, lengths: list[int]) -> list[DraftTree]:
        chosen = select(trees, acceptances, lengths)
        steps.append((trees[0], chosen[0]))
        return chosen

    decoder.budget.select = recording
    tries: Counter = Counter()
    hits: Counter = Counter()
    for q in load_questions(dataset, limit):
        steps.clear()
        out = decoder.generate(q.chat, chat=True, max_new_tokens=tokens).tokens
        at = 1  # out[at - 1] is the root of the next step
        for tree, chosen in steps:
            truth = out[at:]
            on_path = set(_followed(tree, truth))
            for i in range(1, len(tree)):
                if tree.parents[i] in on_path and tree.features is not None:
                    for level in evidence_levels(tree.features[i]):
                        tries[level] += 1
                        hits[level] += i in on_path
            at += len(_followed(chosen, truth))
    print(f"{method} on {dataset} (first {limit} per category), {tokens} new tokens: candidate nodes whose "
          "parent was on the model's path, by evidence key")
    for level in sorted(tries, key=lambda k: (k[0], len(k) > 2, k)):
        if len(level) > 1 and tries[level] >= 30:
            print(f"  {str(level):32s} tries {tries[level]:6d}   right {hits[level] / tries[level]:6.1%}")


def agreement(dtype: str, methods: list[str], tokens: int, threads: int) -> None:
    torch.set_num_threads(threads)
    model, tok = racer.load_model(dtype=dtype)
    questions = load_questions("spec_bench", 1) + load_questions("human_eval", 5) + load_questions("mgsm", 5)
    decoders = {m: racer.Decoder(model, tok, m) for m in methods}
    flips = {m: [] for m in methods}
    for q in questions:
        ids = encode_prompt(tok, q.chat, chat=True)
        t = torch.tensor([ids])
        with torch.inference_mode():
            ref = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=tokens,
                                 top_p=None, top_k=None, temperature=None)[0, len(ids):].tolist()
        for m, d in decoders.items():
            out = d.generate(ids, max_new_tokens=tokens).tokens
            first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
            if first is None and len(out) != len(ref):
                first = min(len(out), len(ref))
            flips[m].append(first)
    print(f"{dtype}, {len(questions)} prompts, {tokens} new tokens, against HF generate in {dtype}:")
    for m, firsts in flips.items():
        diverged = [f for f in firsts if f is not None]
        where = f"; first differing token at {sorted(diverged)}" if diverged else ""
        print(f"  {m}: identical on {len(firsts) - len(diverged)}/{len(firsts)} prompts{where}")


def selftest(threads: int, windows: tuple[int, ...] = (1024, 4096)) -> None:
    """What the self-test costs: at load on the embedded model (median of 4 after one
    warm-up), and past a window on random-weight Mistral models of the embedded model's
    shape with each sliding window in ``windows``."""
    from transformers import MistralConfig, MistralForCausalLM

    from racer.engine import selftest as check

    torch.set_num_threads(threads)
    model, _ = racer.load_model()
    times = []
    for _ in range(5):
        check._checked.pop(model, None)
        start = time.perf_counter()
        check.self_test(model)
        times.append(time.perf_counter() - start)
    print(f"self-test at load, embedded model, {threads} threads: median {statistics.median(times[1:]):.2f} s")
    config, facts = model.config, ModelFacts.of(model)
    for window in windows:
        shape = MistralConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                              num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                              num_key_value_heads=config.num_key_value_heads, vocab_size=facts.vocab_size,
                              head_dim=config.hidden_size // config.num_attention_heads,
                              max_position_embeddings=2 * max(windows), sliding_window=window,
                              attn_implementation="sdpa")
        torch.manual_seed(0)
        windowed = MistralForCausalLM(shape).eval()
        start = time.perf_counter()
        check.self_test(windowed, past_windows=True)
        print(f"self-test past a {window}-token window, random-weight Mistral of that shape: "
              f"{time.perf_counter() - start:.1f} s")


def batch(threads: int, tokens: int, concurrency: tuple[int, ...] = (1, 2, 4, 8),
          methods: tuple[str, ...] = ("none", "pld", "racer")) -> None:
    """In-process continuous batching: C requests at once (Spec-Bench and HumanEval
    prompts, two rounds of C), every method in turn at each C, drafter memory shared
    across requests (the server's default scope); completion tokens per second of the
    whole batch, and the mean verified nodes per request per pass."""
    torch.set_num_threads(threads)
    model, tokenizer = racer.load_model()
    questions = load_questions("spec_bench", limit=1) + load_questions("human_eval", limit=8)
    tables = {}
    for method in methods:  # calibrated once, at the largest batch: a table covers every smaller one
        reference = racer.BatchDecoder(model, tokenizer, method, max_batch=max(concurrency), check=False)
        reference.calibrate()
        tables[method] = reference.cost
    print(f"{tokens} new tokens a request, greedy, {threads} threads; C requests decoded together")
    print(f"| C | method | tokens/s | vs {methods[0]} | nodes/request/pass | same tokens as {methods[0]} |")
    print("|---|---|---|---|---|---|")
    for c in concurrency:
        prompts = [encode_prompt(tokenizer, q.chat, chat=True)
                   for q in questions[: 2 * c]]
        rates, first = {}, None
        for method in methods:
            decoder = racer.BatchDecoder(model, tokenizer, method, max_batch=c, cost=tables[method], check=False)
            start = time.perf_counter()
            ids = [decoder.submit(prompt, max_new_tokens=tokens, scope="server") for prompt in prompts]
            while decoder.busy:
                decoder.step()
            results = [decoder.result(i) for i in ids]
            seconds = time.perf_counter() - start
            rates[method] = sum(len(r.tokens) for r in results) / seconds
            nodes = [s.tree_size for r in results for s in r.steps]
            first = first or [r.tokens for r in results]
            same = sum(r.tokens == f for r, f in zip(results, first))
            print(f"| {c} | {method} | {rates[method]:.1f} | {rates[method] / rates[methods[0]]:.2f}x | "
                  f"{statistics.mean(nodes):.2f} | {same}/{len(results)} |", flush=True)




def run(args: argparse.Namespace) -> None:
    """``racer measure``: the measurement ``args.what`` names, with its options."""
    a = args
    if a.what == "costs":
        costs(a.threads)
    elif a.what == "kernels":
        kernels(a.threads)
    elif a.what == "attention":
        attention(a.threads)
    elif a.what == "runs":
        runs(a.threads)
    elif a.what == "append":
        append(a.threads)
    elif a.what == "selftest":
        selftest(a.threads)
    elif a.what == "batch":
        batch(a.threads, a.tokens, tuple(int(c) for c in a.concurrency.split(",")), tuple(a.batch_methods.split(",")))
    elif a.what == "evidence":
        evidence(a.dataset, a.limit, a.tokens, a.threads, a.method)
    else:
        agreement(a.dtype, a.methods.split(","), a.tokens, a.threads)

