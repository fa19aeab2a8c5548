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
from racer.engine.rows import SlotRows
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths


def rows_of(model, contexts: list[list[int]]) -> SlotRows:
    verifier = TreeVerifier(model)
    rows = SlotRows(verifier, model.config, rows=len(contexts))
    for context in contexts:
        prefilled = TreeVerifier(model, verifier.fast_paths, verifier.facts, verifier.layout)
        prefilled.prefill(context)
        rows.admit(prefilled)
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


@pytest.mark.parametrize("lengths, sizes, one_call", [
    ((7, 30, 3, 18), (5, 1, 12, 8), False),  # unlike rows: attended row by row
    ((20, 22, 19, 21), (6, 5, 6, 4), True),  # alike: one call over padded queries
])
def test_a_packed_pass_gives_the_padded_pass_logits_on_a_tiny_model(monkeypatch, lengths, sizes, one_call):
    import racer.fastpaths.attention as attention

    calls = []
    real = attention._packed_sdpa
    monkeypatch.setattr(attention, "_packed_sdpa", lambda packed, *args: calls.append(packed.padded is not None)
                        or real(packed, *args))
    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size, lengths, sizes)
    assert_packed_equals_padded(model, contexts, trees, atol=1e-5)
    assert calls == [one_call] * model.config.num_hidden_layers


@pytest.mark.real
@pytest.mark.parametrize("lengths, sizes", [((40, 211, 9, 97), (17, 1, 32, 6)), ((150, 160, 155), (8, 7, 8))])
def test_a_packed_pass_gives_the_padded_pass_logits_on_the_real_model(real, lengths, sizes):
    model, _ = real
    contexts, trees = contexts_and_trees(model.config.vocab_size, lengths, sizes)
    assert_packed_equals_padded(model, contexts, trees, atol=1e-3)


def test_an_attention_call_that_refuses_packed_rows_turns_packing_off(monkeypatch):
    import racer.fastpaths.attention as attention

    real = attention._packed_sdpa

    def refusing(packed, *args):
        packed.refused = True
        return real(packed, *args)

    monkeypatch.setattr(attention, "_packed_sdpa", refusing)
    model = make_tiny_llama()
    contexts, trees = contexts_and_trees(model.config.vocab_size)
    rows = rows_of(model, contexts)
    logits = rows.forward(trees)
    assert not rows.packs
    torch.testing.assert_close(logits, rows._padded_forward(trees), atol=0, rtol=0)


def test_models_without_grouped_attention_pad():
    assert not rows_of(make_tiny_llama("eager"), [[1, 2, 3]]).packs


def test_a_batch_decodes_the_same_packed_and_padded():
    from test_batch import tiny_prompts

    model = make_tiny_llama()
    prompts = tiny_prompts()
    answers = {}
    for packed in (True, False):
        batch = BatchDecoder(model, None, "racer:capacity=16", max_batch=4, prefill_chunk=7, cost=shared_cost(),
                             fast_paths=FastPaths(packed_rows=packed))
        answers[packed] = [r.tokens for r in batch.generate_all(prompts, max_new_tokens=24)]
        assert batch.rows.packs is packed  # no pass was refused
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
