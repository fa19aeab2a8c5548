"""Packed batched passes: the rows' trees one after another in one sequence give the
logits a padded pass gives, a model whose attention cannot take them falls back to
padding, and the batch budget spends nodes where they are likeliest to be accepted."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import hf_greedy, make_tiny_llama
from families import shared_cost
from racer.budget import CostModel
from racer.budget.batch import BatchBudget, best_total
from racer.engine.loop import BatchDecoder
from racer.engine.rows import Chunk, SlotRows
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths


def rows_of(model, contexts: list[list[int]]) -> SlotRows:
    verifier = TreeVerifier(model)
    rows = SlotRows(verifier, model.config, rows=len(contexts))
    for context in contexts:
        prefilled = TreeVerifier(model, verifier.fast_paths, verifier.facts, verifier.layout)
        prefilled.prefill(context)
        rows.load(prefilled)
    return rows


def contexts_and_trees(vocab: int, lengths=(7, 30, 3, 18), sizes=(5, 1, 12, 8), seed: int = 0):
    rng = np.random.default_rng(seed)
    contexts = [[int(t) for t in rng.integers(vocab, size=n)] for n in lengths]
    trees = [random_tree(rng, vocab, size, max(1, min(size - 1, 4))) for size in sizes]
    return contexts, trees


def assert_packed_equals_padded(model, contexts, trees, atol: float) -> None:
    rows = rows_of(model, contexts)
    assert rows.packs
    packed = rows.forward(trees)
    assert rows.packs  # the pass was taken packed, not refused
    padded = rows._padded_forward(trees)
    assert packed.shape == padded.shape == (len(trees), max(map(len, trees)), padded.shape[-1])
    for row, tree in enumerate(trees):
        torch.testing.assert_close(packed[row, : len(tree)], padded[row, : len(tree)], atol=atol, rtol=0)
        assert torch.equal(packed[row, : len(tree)].argmax(-1), padded[row, : len(tree)].argmax(-1))


@pytest.mark.parametrize("lengths, sizes, call_keys, layout", [
    ((7, 30, 3, 18), (5, 1, 12, 8), 0, (0, 4)),  # calls cost nothing: every row attended on its own
    ((20, 22, 19, 21), (6, 5, 6, 4), 550, (1, 0)),  # alike: one call over padded queries
    ((20, 22, 400, 19), (6, 5, 6, 4), 550, (1, 2)),  # one long row: the short ones before it padded together
])
def test_a_packed_pass_gives_the_padded_pass_logits_on_a_tiny_model(monkeypatch, lengths, sizes, call_keys, layout):
    import racer.fastpaths.attention as attention

    layouts = []
    real = attention._packed_sdpa
    monkeypatch.setattr(attention, "CALL_KEYS", call_keys)
    monkeypatch.setattr(attention, "_packed_sdpa", lambda packed, *args: layouts.append(
        (len(packed.padded), len(packed.segments))) or real(packed, *args))
    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size, lengths, sizes)
    assert_packed_equals_padded(model, contexts, trees, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert layouts[layers:] == [layout] * layers  # after the probe pass


def partitions(count: int):
    """Every split of ``count`` consecutive items into runs, as (first, end) pairs."""
    for cuts in itertools.product((False, True), repeat=count - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [count]
        yield list(zip(bounds, bounds[1:]))


def test_padded_groups_is_the_cheapest_split_into_runs_of_consecutive_rows():
    from racer.fastpaths.attention import CALL_KEYS, padded_groups

    def cost(runs, rows, sizes, spans):
        if any(rows[i] + 1 != rows[i + 1] for first, end in runs for i in range(first, end - 1)):
            return float("inf")
        return sum(CALL_KEYS + (end - first) * max(spans[first:end]) * max(sizes[first:end]) ** 0.5
                   for first, end in runs)

    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 8)
        rows = sorted(rng.sample(range(count + 2), count))
        sizes = [rng.choice((1, 2, 4, 8, 16, 64)) for _ in range(count)]
        spans = [size + rng.choice((3, 50, 300, 900, 3000)) for size in sizes]
        runs = padded_groups(rows, sizes, spans)
        assert [first for first, _ in runs] + [count] == [0] + [end for _, end in runs]  # covers every tree once
        best = min(cost(split, rows, sizes, spans) for split in partitions(count))
        assert cost(runs, rows, sizes, spans) == pytest.approx(best)


@pytest.mark.real
@pytest.mark.parametrize("lengths, sizes", [((40, 211, 9, 97), (17, 1, 32, 6)), ((150, 160, 155), (8, 7, 8))])
def test_a_packed_pass_gives_the_padded_pass_logits_on_the_real_model(real, lengths, sizes):
    model, _ = real
    contexts, trees = contexts_and_trees(model.config.vocab_size, lengths, sizes)
    assert_packed_equals_padded(model, contexts, trees, atol=1e-3)


def test_a_model_whose_attention_refuses_packed_rows_pads(monkeypatch):
    import racer.fastpaths.attention as attention

    real = attention._packed_sdpa

    def refusing(packed, *args):
        packed.refused = True
        return real(packed, *args)

    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size)
    monkeypatch.setattr(attention, "_packed_sdpa", refusing)
    rows = rows_of(model, contexts)  # the probe pass is refused
    assert not rows.packs
    torch.testing.assert_close(rows.forward(trees), rows._padded_forward(trees), atol=0, rtol=0)
    monkeypatch.setattr(attention, "_packed_sdpa", real)
    rows = rows_of(model, contexts)
    assert rows.packs
    monkeypatch.setattr(attention, "_packed_sdpa", refusing)  # a refusal the probe did not see: never a wrong pass
    with pytest.raises(RuntimeError, match="refused packed rows"):
        rows.forward(trees)


def assert_chunks_ride_as_a_prefill_alone(model, contexts, trees, prompt, chunk_size, atol):
    """The prompt's chunks, each in a packed pass with the rows' trees: the trees get the
    logits they get without it, and the prompt's row ends up with the KV and last logits of
    a prefill of the whole prompt alone."""
    alone = TreeVerifier(model)
    whole = alone.prefill(prompt, keep=0)
    rows = rows_of(model, contexts)
    without = rows.forward(trees)
    held = rows.begin_prompt(prompt)
    assert held.row == len(contexts) and held.cached == 0
    for start in range(0, len(prompt), chunk_size):
        keep = 0 if start == 0 else 1  # every position's logits, then the last one's
        chunk = Chunk(held, prompt[start : start + chunk_size], keep)
        logits = rows.forward(trees, list(range(len(trees))), chunk)
        for row, tree in enumerate(trees):
            torch.testing.assert_close(logits[row, : len(tree)], without[row, : len(tree)], atol=atol, rtol=0)
        end = start + len(chunk.tokens)
        assert held.cached == end == rows.lengths[held.row]
        want = whole[start:end] if keep == 0 else whole[end - 1 : end]
        torch.testing.assert_close(chunk.logits, want, atol=atol, rtol=0)
    assert rows.admit(held) == len(contexts)
    kept = rows.slots.row_kv(held.row, len(prompt))
    for (keys, values), layer in zip(kept, [layer for layer in alone.cache.layers]):
        torch.testing.assert_close(keys, layer.keys[0, :, : len(prompt)], atol=atol, rtol=0)
        torch.testing.assert_close(values, layer.values[0, :, : len(prompt)], atol=atol, rtol=0)


def test_a_prompt_chunk_rides_in_the_pass_as_its_prefill_alone_on_a_tiny_model():
    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size)
    prompt = [int(t) for t in np.random.default_rng(3).integers(model.config.vocab_size, size=23)]
    assert_chunks_ride_as_a_prefill_alone(model, contexts, trees, prompt, 8, atol=1e-5)


@pytest.mark.real
def test_a_prompt_chunk_rides_in_the_pass_as_its_prefill_alone_on_the_real_model(real):
    model, _ = real
    contexts, trees = contexts_and_trees(model.config.vocab_size, (40, 211, 9), (17, 1, 6))
    prompt = [int(t) for t in np.random.default_rng(3).integers(model.config.vocab_size, size=150)]
    assert_chunks_ride_as_a_prefill_alone(model, contexts, trees, prompt, 64, atol=1e-3)


def test_a_prompt_chunk_rides_only_where_the_rows_pack():
    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size)
    verifier = TreeVerifier(model, FastPaths(packed_rows=False))
    rows = SlotRows(verifier, model.config, rows=len(contexts) + 1)
    held = rows.begin_prompt([1, 2, 3])
    assert held.row is None and held.verifier is not None  # prefilled apart, copied in by admit
    with pytest.raises(RuntimeError, match="packed pass"):
        rows.forward([], [], Chunk(held, [1, 2, 3], 1))


def test_models_without_grouped_attention_pad():
    assert not rows_of(make_tiny_llama("eager"), [[1, 2, 3]]).packs


def test_a_batch_decodes_the_same_packed_and_padded():
    """Packed, a joining request's chunks ride in the decoding rows' passes, but its
    prompt's last one, which takes a pass of its own so that it joins that step's pass;
    several waiting requests' chunks share a step's pass where they fit its bound."""
    from test_batch import tiny_prompts

    model = make_tiny_llama()
    prompts = tiny_prompts()
    answers = {}
    for packed in (True, False):
        batch = BatchDecoder(model, None, "racer:capacity=16", max_batch=4, prefill_chunk=7, cost=shared_cost(),
                             fast_paths=FastPaths(packed_rows=packed))
        passes = []

        def spy(name, real):
            def call(*args, **kwargs):
                chunk = args[2] if len(args) > 2 else kwargs.get("chunk")
                chunks = args[0] if name == "prefill" else [chunk] if chunk is not None else []
                owners = [next(r for r in batch._waiting if r.prompt is c.prompt) for c in chunks]
                lasts = [c.prompt.cached + len(c.tokens) >= len(r.ids) for c, r in zip(chunks, owners)]
                assert sum(len(c.tokens) for c in chunks) <= 7  # the step's bound, in all
                if name == "prefill" or args[0]:  # chunks' own pass goes through forward([], ...) too
                    passes.append((name, batch.active, lasts))
                return real(*args, **kwargs)
            return call

        for name in ("forward", "prefill"):
            setattr(batch.rows, name, spy(name, getattr(batch.rows, name)))
        answers[packed] = [r.tokens for r in batch.generate_all(prompts, max_new_tokens=24)]
        assert batch.rows.packs is packed
        riding = [last for name, _, lasts in passes if name == "forward" for last in lasts]
        apart = [(active, last) for name, active, lasts in passes if name == "prefill" for last in lasts]
        shared = [len(lasts) for name, _, lasts in passes if name == "prefill"]
        if packed:
            assert riding and not any(riding)  # no prompt's last chunk rides
            assert all(last or active == 0 for active, last in apart)
            assert any(active > 0 for active, _ in apart)
            assert max(shared) > 1
        else:
            assert not riding and any(active > 0 and not last for active, last in apart)
            assert max(shared) == 1
    assert answers[True] == answers[False] == [hf_greedy(model, p, 24) for p in prompts]


def brute_force(expected, cost):
    best = None
    for kept in itertools.product(*[range(1, len(e) + 1) for e in expected]):
        rate = sum(e[k - 1] for e, k in zip(expected, kept)) / cost(sum(kept))
        if best is None or rate > best[1] + 1e-12 or (abs(rate - best[1]) <= 1e-12 and sum(kept) < sum(best[0])):
            best = (list(kept), rate)
    return best


def concave(rng: random.Random, size: int) -> list[float]:
    gains = sorted((rng.random() for _ in range(size - 1)), reverse=True)
    return list(itertools.accumulate([1.0] + gains))


@pytest.mark.parametrize("seed", range(40))
def test_the_packed_budget_finds_the_best_allocation(seed):
    rng = random.Random(seed)
    expected = [concave(rng, rng.randint(1, 5)) for _ in range(rng.randint(1, 4))]
    fixed, per_node = rng.uniform(0.5, 4), rng.uniform(0.05, 1)
    cost = lambda total: fixed + per_node * total  # noqa: E731
    kept, rate = best_total(expected, cost)
    want_kept, want_rate = brute_force(expected, cost)
    assert rate == pytest.approx(want_rate)
    assert sum(kept) == sum(want_kept)


def test_the_packed_budget_keeps_roots_where_no_node_pays():
    assert best_total([[1.0, 1.9, 2.7], [1.0, 1.0, 1.0]], lambda total: 1.0)[0] == [3, 1]
    assert best_total([[1.0, 1.5], [1.0, 1.5]], lambda total: float(total))[0] == [1, 1]  # ties: fewer nodes
    with pytest.raises(ValueError, match="cost: expected a positive time"):
        best_total([[1.0, 1.5]], lambda total: 0.0)


def test_a_packed_batch_gives_its_nodes_to_the_likelier_rows():
    from test_batch_budget import Fixed, wide_tree

    # Passes cost 10 ms plus 0.5 ms a node: a likely node pays, an unlikely one does not.
    cost = CostModel([1, 256], [0.0105, 0.138], length=0, variance=[1e-12, 1e-12])
    tree = wide_tree()
    likely, unlikely = Fixed(0.9), Fixed(0.01)
    budget = BatchBudget(cost)
    budget.packed = True
    kept = budget.select([tree] * 4, [likely, unlikely, likely, unlikely], [0] * 4)
    assert [len(t) for t in kept][1::2] == [1, 1]
    assert all(len(t) > 1 for t in kept[::2]) and budget.last_cap == max(len(t) for t in kept)
    budget.packed = False  # padded: one cap for every row
    assert len({len(t) for t in budget.select([tree] * 4, [likely, unlikely, likely, unlikely], [0] * 4)}) == 1
