"""Tree verification: every node's logits match sequential decoding of its path, and
decoding continues correctly after KV compaction."""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import needs_attention_interface, needs_cache_layers
from racer.drafting.tree import chain
from racer.engine.selftest import UnsupportedModelError, random_tree, self_test, sequential_logits, tolerance
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths


def _check_tree(model, context, tree, kernel="model"):
    verifier = TreeVerifier(model)
    verifier.use_kernel(kernel)
    verifier.prefill(context)
    got = verifier.verify(tree)
    want = sequential_logits(model, context, tree)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= tolerance(verifier.dtype, want.abs().max().item())
    return verifier, got


@pytest.mark.parametrize("seed", range(12))
def test_random_trees_match_sequential_decoding_tiny(tiny, seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 65))
    tree = random_tree(rng, tiny.config.vocab_size, size, max_depth=int(rng.integers(1, 9)))
    context = rng.integers(tiny.config.vocab_size, size=int(rng.integers(1, 20))).tolist()
    _check_tree(tiny, context, tree)


@pytest.mark.parametrize("seed", range(3))
def test_random_trees_match_sequential_decoding_real(real, seed):
    model, _ = real
    rng = np.random.default_rng(100 + seed)
    tree = random_tree(rng, model.config.vocab_size, [64, 24, 9][seed], max_depth=8)
    context = rng.integers(model.config.vocab_size, size=12).tolist()
    _check_tree(model, context, tree)


@pytest.mark.parametrize("kernel", ["weight_major", "packed", "hybrid"])
@pytest.mark.parametrize("size", [2, 3, 8, 16])
def test_kernel_trees_match_sequential_decoding_real(real, size, kernel):
    model, _ = real
    rng = np.random.default_rng(200 + size)
    tree = random_tree(rng, model.config.vocab_size, size, max_depth=min(size - 1, 6))
    context = rng.integers(model.config.vocab_size, size=12).tolist()
    verifier, got = _check_tree(model, context, tree, kernel=kernel)
    assert verifier.kernel_of(size) == kernel  # the kernel really ran
    _, stock = _check_tree(model, context, tree)
    # Where the best two logits are further apart than the two kernels' rounding can
    # move them, both kernels pick the same token.
    top2 = stock.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance(verifier.dtype, stock.abs().max().item())
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], stock.argmax(-1)[clear])


def test_wrong_mask_is_detected(tiny):
    """Negative control: letting every node see every other node must fail the check."""
    rng = np.random.default_rng(5)
    tree = random_tree(rng, tiny.config.vocab_size, 12, 4)
    context = [1, 2, 3]
    verifier = TreeVerifier(tiny)
    verifier.prefill(context)
    mask = torch.zeros((1, 1, len(tree), verifier.cached + len(tree)))
    ids = torch.tensor([tree.tokens])
    pos = (torch.tensor(tree.depths) + verifier.cached).unsqueeze(0)
    wrong = verifier.forward(ids, pos, mask, len(tree))
    want = sequential_logits(tiny, context, tree)
    assert (wrong - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("seed", range(6))
def test_compaction_then_continuing_matches_a_fresh_run(tiny, seed):
    rng = np.random.default_rng(seed)
    vocab = tiny.config.vocab_size
    context = rng.integers(vocab, size=6).tolist()
    verifier = TreeVerifier(tiny)
    verifier.prefill(context)
    for _ in range(3):  # several steps, each accepting a random root-to-node path
        tree = random_tree(rng, vocab, int(rng.integers(1, 20)), 5)
        verifier.verify(tree)
        path = tree.path_to(int(rng.integers(len(tree))))
        verifier.commit(path, len(tree))
        context += [tree.tokens[i] for i in path]
    # The cache now holds exactly `context`; continue with a new tree and compare
    # with a fresh prefill of the whole context.
    tree = random_tree(rng, vocab, 10, 4)
    got = verifier.verify(tree)
    want = sequential_logits(tiny, context, tree)
    assert verifier.cached == len(context)
    assert (got - want).abs().max().item() < 2e-3


def test_self_test_passes_on_supported_models(real, tiny):
    assert self_test(real[0]) <= 2e-3
    assert self_test(tiny) <= 2e-3


def test_unsupported_attention_is_refused_clearly():
    from conftest import make_tiny_llama

    model = make_tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="attn_implementation"):
        self_test(model)


def test_tree_too_deep_for_the_context_window_is_refused(tiny):
    verifier = TreeVerifier(tiny)
    verifier.prefill(list(range(90)))
    with pytest.raises(ValueError, match="context window"):
        verifier.verify(chain(1, list(range(2, 10))))  # depth 8 at position 90 + 8 > 96


def _sdpa_spy(monkeypatch):
    """Every attention call of a pass: (query heads, KV heads, grouped in place), from
    torch's SDPA and from tree attention's few-query products alike."""
    import racer.fastpaths.attention as attention

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    few = attention.few_query_attention

    def spy(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    def few_spy(query, key, value, mask, scaling, *spans):
        calls.append((query.shape[1], key.shape[1], True))
        return few(query, key, value, mask, scaling, *spans)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "few_query_attention", few_spy)
    return calls


@needs_attention_interface
@pytest.mark.parametrize("shape", ["tree", "chain", "long chain"])
def test_tree_attention_reads_grouped_kv_heads_in_place(real, monkeypatch, shape):
    """On the real model (3 KV heads for 9 query heads), branching trees and chains of
    several tokens (a few: tree attention's stacked products; more: torch's grouped
    SDPA) attend to the cache's own KV heads: no layer sees them repeated."""
    model, _ = real
    rng = np.random.default_rng(7)
    tree = (random_tree(rng, model.config.vocab_size, 9, 4) if shape == "tree" else chain(5, [6, 7, 8])
            if shape == "chain" else chain(5, list(range(6, 30))))
    context = rng.integers(model.config.vocab_size, size=12).tolist()
    verifier = TreeVerifier(model)
    assert verifier.tree_attention is not None
    verifier.prefill(context)
    calls = _sdpa_spy(monkeypatch)
    got = verifier.verify(tree)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert len(calls) == model.config.num_hidden_layers
    assert all(gqa and heads == groups * kv_heads for heads, kv_heads, gqa in calls)
    assert model.config._attn_implementation == "sdpa"  # switched for the pass only
    want = sequential_logits(model, context, tree)
    assert (got - want).abs().max().item() <= tolerance(verifier.dtype, want.abs().max().item())
    verifier.tree_attention = None  # the stock path: the same logits
    verifier.prefill(context)
    assert (verifier.verify(tree) - got).abs().max().item() <= tolerance(verifier.dtype, want.abs().max().item())


@pytest.mark.parametrize("batch, queries, length", [(1, 1, 7), (3, 5, 40), (8, 16, 300), (2, 9, 1)])
def test_few_query_attention_is_sdpas_math(batch, queries, length):
    """Against torch's SDPA on grouped heads, with a tree mask (finfo.min where a node
    may not look) that also masks whole padded rows."""
    from racer.fastpaths.attention import few_query_attention

    gen = torch.Generator().manual_seed(batch * 100 + queries)
    query = torch.randn(batch, 9, queries, 64, generator=gen)
    key, value = (torch.randn(batch, 3, length + queries, 64, generator=gen) for _ in range(2))
    allowed = torch.rand(batch, 1, queries, length + queries, generator=gen) < 0.7
    allowed[..., :1] = True
    allowed[-1, :, -1] = False  # a padded row that may look nowhere
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for scaling in (None, 0.11):
        want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                                enable_gqa=True)
        got = few_query_attention(query, key, value, mask, scaling)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("spans, per_row", [((12, 40, 7), True), ((40, 38, 40), False), ((5, 40), True)])
def test_few_query_attention_over_row_spans_is_the_padded_math(monkeypatch, spans, per_row):
    """Rows whose masks allow nothing past their spans: computed row by row over their
    own spans where padding would be most of the work, batched otherwise; the same
    values as the padded products and as torch's SDPA."""
    import racer.fastpaths.attention as attention

    batch, queries, length = len(spans), 4, max(spans)
    gen = torch.Generator().manual_seed(sum(spans))
    query = torch.randn(batch, 9, queries, 64, generator=gen)
    key, value = (torch.randn(batch, 3, length, 64, generator=gen) for _ in range(2))
    allowed = torch.rand(batch, 1, queries, length, generator=gen) < 0.7
    allowed[..., :1] = True
    for row, span in enumerate(spans):
        allowed[row, ..., span:] = False
        key[row, :, span:] = float("nan") if per_row else 0.0  # never read where rows go one by one
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    shapes = []
    products = attention._grouped_products
    monkeypatch.setattr(attention, "_grouped_products",
                        lambda q, k, *rest: shapes.append(k.shape[2]) or products(q, k, *rest))
    got = attention.few_query_attention(query, key, value, mask, None, spans)
    assert shapes == (list(spans) if per_row else [length])
    clean = key.nan_to_num(0.0)
    want = torch.nn.functional.scaled_dot_product_attention(query, clean, value, attn_mask=mask, enable_gqa=True)
    assert (got - want).abs().max().item() < 1e-5
    assert (got - products(query, clean, value, mask, None)).abs().max().item() < 1e-5


@needs_attention_interface
def test_a_batched_pass_tells_tree_attention_each_rows_span(real, monkeypatch):
    """On the real model, a batch of a short and a long prompt in padded passes (as a
    windowed model's are; packed passes attend row by row: ``test_packed``): every
    layer's few-query products get each row's span (its context and the pass's nodes),
    the short row is attended over its own span alone, and both answers are plain
    greedy decoding's."""
    import racer.fastpaths.attention as attention
    from conftest import hf_greedy
    from racer.engine.loop import BatchDecoder

    model, tokenizer = real
    rng = np.random.default_rng(3)
    short = rng.integers(100, 5000, size=12).tolist()
    long = (rng.integers(100, 5000, size=60).tolist() * 5)[:300]
    seen = []
    few = attention.few_query_attention

    def spy(query, key, value, mask, scaling, spans=None):
        seen.append((key.shape[2], query.shape[2], None if spans is None else list(spans)))
        return few(query, key, value, mask, scaling, spans)

    monkeypatch.setattr(attention, "few_query_attention", spy)
    batch = BatchDecoder(model, tokenizer, "racer:capacity=8", max_batch=2, check=False,
                         fast_paths=FastPaths(packed_rows=False))
    first, second = batch.generate_all([short, long], max_new_tokens=12)
    batched = [(length, nodes, spans) for length, nodes, spans in seen if spans is not None and len(spans) == 2]
    assert batched and all(max(spans) == length and min(spans) < length / 2 for length, _, spans in batched)
    assert first.tokens == hf_greedy(model, short, 12) and second.tokens == hf_greedy(model, long, 12)


@needs_attention_interface
def test_tree_attention_gives_the_config_back_when_a_pass_fails(tiny):
    verifier = TreeVerifier(tiny)
    if verifier.tree_attention is None:
        assert tiny.config._attn_implementation == "eager"
        return
    verifier.prefill([1, 2, 3])
    tree = random_tree(np.random.default_rng(0), tiny.config.vocab_size, 5, 2)
    tree = dataclasses.replace(tree, tokens=(10**6,) + tree.tokens[1:])  # past the embedding table: the pass raises
    with pytest.raises(Exception):
        verifier.verify(tree)
    assert tiny.config._attn_implementation == "sdpa"


@needs_attention_interface
def test_tree_attention_applies_only_where_it_is_exact(monkeypatch):
    from conftest import make_tiny_llama
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from racer.fastpaths.attention import tree_attention

    assert tree_attention(make_tiny_llama("sdpa"), "cpu") is not None
    assert tree_attention(make_tiny_llama("eager"), "cpu") is None  # eager layers: their own arithmetic
    no_groups = make_tiny_llama("sdpa")
    for layer in no_groups.model.layers:
        layer.self_attn.num_key_value_groups = 1
    assert tree_attention(no_groups, "cpu") is None  # nothing repeated to save
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", lambda *a, **k: None)
    assert tree_attention(make_tiny_llama("sdpa"), "cpu") is None  # the user's own "sdpa" is kept


def test_tree_sdpa_keeps_the_stock_path_for_what_it_does_not_handle(monkeypatch):
    """Calls without a mask, without grouped heads, or with arguments that change the
    attention (soft-capping, windows, sinks) go to transformers' own SDPA attention."""
    import racer.fastpaths.attention as attention

    stock = []
    monkeypatch.setattr(attention, "_stock_sdpa", lambda: lambda *a, **k: stock.append(k) or ("stock", None))
    layer = type("Layer", (), {"num_key_value_groups": 2})()
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)
    mask = torch.zeros(1, 1, 3, 10)
    assert attention.tree_sdpa(layer, query, key, key, None)[0] == "stock"
    assert attention.tree_sdpa(layer, query, key, key, mask, softcap=30.0)[0] == "stock"
    assert attention.tree_sdpa(layer, query, key, key, mask, sliding_window=4)[0] == "stock"
    assert attention.tree_sdpa(type("Layer", (), {})(), query, key.repeat(1, 2, 1, 1), key, mask)[0] == "stock"
    assert len(stock) == 4
    out, _ = attention.tree_sdpa(layer, query, key, key, mask, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), key.repeat_interleave(2, dim=1), attn_mask=mask, scale=0.5)
    assert len(stock) == 4 and out.shape == (1, 3, 4, 8)
    torch.testing.assert_close(out, want.transpose(1, 2))


@needs_cache_layers
def test_growing_cache_appends_in_place_and_gives_dynamic_cache_logits(tiny, monkeypatch):
    from transformers.cache_utils import DynamicLayer

    import racer.fastpaths.kvcache as kvcache
    from racer.fastpaths.kvcache import GrowingLayer

    monkeypatch.setattr(kvcache, "_MIN_CAPACITY", 8)  # so that this short run grows several times
    grown = []
    grow = GrowingLayer._grow
    monkeypatch.setattr(GrowingLayer, "_grow", lambda self, *a: (grown.append(self), grow(self, *a)))
    rng = np.random.default_rng(3)
    vocab = tiny.config.vocab_size
    context = rng.integers(vocab, size=10).tolist()
    steps = []
    for _ in range(12):
        tree = random_tree(rng, vocab, int(rng.integers(2, 16)), 5)
        steps.append((tree, tree.path_to(int(rng.integers(len(tree))))))
    runs = {}
    for name, fast_paths in (("dynamic", FastPaths(growing_cache=False)), ("growing", FastPaths())):
        verifier = TreeVerifier(tiny, fast_paths)
        verifier.prefill(context)
        logits = []
        for tree, path in steps:
            logits.append(verifier.verify(tree))
            verifier.commit(path, len(tree))
            layer = verifier.cache.layers[0]
            assert isinstance(layer, GrowingLayer) == (name == "growing")
            assert name == "growing" or type(layer) is DynamicLayer
            assert layer.get_seq_length() == verifier.cached == layer.keys.shape[-2]
        runs[name] = (logits, sum(layer is verifier.cache.layers[0] for layer in grown), verifier.cached)
    assert runs["growing"][2] == runs["dynamic"][2]
    for got, want in zip(runs["growing"][0], runs["dynamic"][0]):
        assert torch.equal(got, want)  # the same values attended to: the same logits, bit for bit
    # Grown by doubling: a new buffer a few times over 12 steps and the prefill, not on every step.
    assert 1 < runs["growing"][1] <= 4
