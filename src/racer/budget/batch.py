"""The draft budget of a batch: how many nodes each request's tree keeps when every
active request is verified in one pass. Pure Python (no torch).

A batched pass pads every tree to the largest, so it costs what ``rows x nodes``
rows cost, whichever request holds the nodes; giving one request more nodes than the
others costs as much as giving them all as many. The budget therefore chooses one
node cap N for the step: each request keeps its N most probable candidates (its best
subtree of that size, ``racer.budget.selection``), and N maximises the whole batch's
expected emitted tokens per second, ``sum_b E_b(N) / cost(B * N, cache)``. As the
batch grows, a node costs B rows, so N shrinks, down to 1 (no drafts) when drafting
no longer pays.
"""

from __future__ import annotations

import random
from typing import Sequence

from racer.budget.acceptance import AcceptanceModel
from racer.budget.selection import CostCurve, path_probabilities
from racer.drafting.tree import DraftTree


def expected_by_size(tree: DraftTree, probs: Sequence[float]) -> tuple[list[int], list[float]]:
    """The tree's candidates, most probable first (parents before children on ties), and
    the expected emitted tokens of its best subtree of each size 1..len(tree)."""
    path = path_probabilities(tree.parents, probs)
    order = sorted(range(1, len(tree)), key=lambda i: (-path[i], tree.depths[i], i))
    expected = [1.0]
    for node in order:
        expected.append(expected[-1] + path[node])
    return order, expected


def best_cap(expected: Sequence[Sequence[float]], cost: "callable", largest: int) -> tuple[int, float]:
    """The node cap N (1..``largest``) that maximises the batch's expected tokens per
    second, ``sum_b expected[b][min(N, len_b) - 1] / cost(N)``, and that rate. Ties go to
    the smaller cap."""
    best, best_rate = 1, -1.0
    for cap in range(1, largest + 1):
        tokens = sum(e[min(cap, len(e)) - 1] for e in expected)
        seconds = float(cost(cap))
        if not seconds > 0:
            raise ValueError(f"cost: expected a positive time for a cap of {cap} nodes, got {seconds}")
        rate = tokens / seconds
        if rate > best_rate:
            best, best_rate = cap, rate
    return best, best_rate


class BatchBudget:
    """Per step, the node cap and each request's kept subtree, from the step-cost curve
    (a function of the rows in a pass and the cache length) and each request's own
    acceptance model."""

    def __init__(self, cost: CostCurve, seed: int = 0) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.last_cap = 1

    def select(self, trees: Sequence[DraftTree], acceptances: Sequence[AcceptanceModel],
               cached: Sequence[int]) -> list[DraftTree]:
        if not trees:
            return []
        ranked = [expected_by_size(tree, model.probabilities(tree, explore=True))
                  for tree, model in zip(trees, acceptances)]
        draw = getattr(self.cost, "draw", None)
        predict = draw(self.rng) if draw is not None else self.cost.predict
        rows = len(trees)
        longest = max(cached)
        largest = max(len(tree) for tree in trees)
        cap, _ = best_cap([expected for _, expected in ranked], lambda n: predict(rows * n, longest), largest)
        self.last_cap = cap
        return [tree.subtree(sorted([0] + order[: cap - 1])) for tree, (order, _) in zip(trees, ranked)]

    def observe(self, rows: int, nodes: int, cached: int, seconds: float) -> None:
        """A pass of ``rows`` trees padded to ``nodes`` nodes took ``seconds``."""
        self.cost.refresh(rows * nodes, cached, seconds)

    def finish(self) -> None:
        save = getattr(self.cost, "save", None)
        if save is not None:
            save()
