"""The batch's draft budget: one node cap for the step, chosen for the whole batch's
tokens per second; it shrinks as the batch grows and vanishes when drafts do not pay."""

from __future__ import annotations

import pytest

from racer.budget import AcceptanceModel, CostModel
from racer.budget.batch import BatchBudget, best_cap, expected_by_size
from racer.drafting.tree import TreeBuilder


def wide_tree(children: int = 6, grandchildren: int = 2):
    builder = TreeBuilder(0, 1 + children * (1 + grandchildren))
    for c in range(children):
        child = builder.add_child(0, 10 + c)
        for g in range(grandchildren):
            builder.add_child(child, 100 + 10 * c + g)
    return builder.build()


def test_expected_tokens_grow_by_path_probability_most_probable_first():
    tree = wide_tree(2, 1)  # a root, two children, a grandchild under each
    probs = [1.0] + [0.5] * (len(tree) - 1)
    order, expected = expected_by_size(tree, probs)
    assert [tree.depths[i] for i in order] == [1, 1, 2, 2]
    assert expected == pytest.approx([1.0, 1.5, 2.0, 2.25, 2.5])


def test_the_cap_maximises_the_batch_rate_and_ties_go_smaller():
    flat = lambda n: 1.0  # noqa: E731 - a GPU-like curve: every node is free
    assert best_cap([[1, 1.5, 1.7], [1, 1.2]], flat, 3)[0] == 3
    linear = lambda n: float(n)  # noqa: E731 - a node costs as much as the root
    assert best_cap([[1, 1.5, 1.7], [1, 1.2]], linear, 3) == (1, 2.0)


class Fixed:
    """An acceptance model that gives every draft node probability ``p``."""

    def __init__(self, p: float) -> None:
        self.p = p

    def probabilities(self, tree, explore: bool = False) -> list[float]:
        return [1.0] + [self.p] * (len(tree) - 1)


def test_the_cap_shrinks_as_the_batch_grows():
    # Passes cost 10 ms plus 2 ms a row: a row is cheap alone, dear times sixteen.
    cost = CostModel([1, 256], [0.012, 0.522], length=0, variance=[1e-12, 1e-12])
    tree = wide_tree()
    probs = Fixed(0.6)
    caps = []
    for rows in (1, 2, 4, 8, 16, 32):
        budget = BatchBudget(cost)
        kept = budget.select([tree] * rows, [probs] * rows, [0] * rows)
        assert len({len(t) for t in kept}) == 1 and all(t.tokens[0] == 0 for t in kept)
        caps.append(budget.last_cap)
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1], caps


def test_drafts_vanish_when_they_no_longer_pay():
    cost = CostModel([1, 64], [0.01, 0.64], length=0)  # every row costs as much as a whole pass
    never = AcceptanceModel()
    tree = wide_tree()
    for _ in range(50):  # nothing is ever accepted
        never.observe(tree, [0])
    budget = BatchBudget(cost)
    kept = budget.select([tree] * 4, [never] * 4, [0] * 4)
    assert budget.last_cap == 1 and all(len(t) == 1 for t in kept)
