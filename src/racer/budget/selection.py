"""Choosing how much of a candidate tree to verify: the subtree that maximises expected
emitted tokens per unit of verification cost. Pure Python (no torch).

Each candidate node carries the probability that it is accepted given that its parent
is; its path probability is the product along the path from the root. A verified
subtree S (closed under parents, root included) emits ``1 + sum of path probabilities
over S's draft nodes`` tokens in expectation (accepted drafts plus the model's own next
token). Path probabilities never grow down a path, so for every size n the n most
probable nodes (parents first on ties) form the best subtree of that size, and the
best subtree overall is the best of those prefixes.
"""

from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence

from racer.budget.acceptance import AcceptanceModel
from racer.drafting.tree import DraftTree


def path_probabilities(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """Path probability of every node; ``parents[i] < i`` and ``parents[0] == -1``."""
    if not parents or parents[0] != -1:
        raise ValueError("parents: expected node 0 to be the root (parent -1)")
    if len(accept) != len(parents):
        raise ValueError(f"accept: expected {len(parents)} probabilities, got {len(accept)}")
    out = [1.0] * len(parents)
    for i in range(1, len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"parents: node {i} has parent {p}; expected a node before it")
        q = float(accept[i])
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"accept: node {i} has probability {q}; expected a value in [0, 1]")
        out[i] = out[p] * q
    return out


def best_subtree(parents: Sequence[int], accept: Sequence[float],
                 cost: Callable[[int], float]) -> tuple[list[int], float]:
    """The node indices (ascending, root first) of the subtree that maximises expected
    emitted tokens / ``cost(size)``, and that ratio. Ties go to the smaller tree, except
    where the larger one costs the same: a node that costs nothing is kept, so a flat
    (GPU-like) curve verifies the whole candidate tree, even nodes whose path
    probability is too small to change the sum in floating point."""
    probs = path_probabilities(parents, accept)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    # Most probable first; on ties shallower, then earlier: a parent always precedes its child.
    order = sorted(range(1, len(parents)), key=lambda i: (-probs[i], depth[i], i))
    best_cost = _checked(cost, 1)
    best_size, best_rate, expected = 1, 1.0 / best_cost, 1.0
    for size, node in enumerate(order, start=2):
        expected += probs[node]
        seconds = _checked(cost, size)
        rate = expected / seconds
        if rate > best_rate or (rate == best_rate and seconds == best_cost):
            best_size, best_rate, best_cost = size, rate, seconds
    return sorted([0] + order[: best_size - 1]), best_rate


def _checked(cost: Callable[[int], float], size: int) -> float:
    value = float(cost(size))
    if not value > 0:
        raise ValueError(f"cost: expected a positive time for {size} nodes, got {value}")
    return value


class CostCurve(Protocol):
    """What the budget needs of a step-cost model (``racer.budget.cost.CostModel`` is one). A
    curve that also has ``draw(rng)`` (a plausible curve, as a ``predict`` function) is
    chosen by a fresh draw each step, so that sizes whose cost it is unsure of get
    verified now and then."""

    def predict(self, nodes: int, cached: int) -> float: ...

    def refresh(self, nodes: int, cached: int, seconds: float) -> None: ...


class DraftBudget:
    """Per step: keep the part of a drafter's candidate tree that maximises expected
    emitted tokens per second, from a cost curve and the acceptance model."""

    def __init__(self, cost: CostCurve, acceptance: AcceptanceModel | None = None, seed: int = 0) -> None:
        self.cost = cost
        self.acceptance = acceptance or AcceptanceModel()
        self.rng = random.Random(seed)

    def select(self, tree: DraftTree, cached: int) -> DraftTree:
        if len(tree) == 1:
            return tree
        probs = self.acceptance.probabilities(tree, explore=True)
        draw = getattr(self.cost, "draw", None)
        predict = draw(self.rng) if draw is not None else self.cost.predict
        nodes, _ = best_subtree(tree.parents, probs, lambda n: predict(n, cached))
        return tree.subtree(nodes)

    def observe(self, tree: DraftTree, accepted: Sequence[int], cached: int, seconds: float) -> None:
        """What the step that verified ``tree`` at cache length ``cached`` revealed:
        the accepted path and how long the whole step took."""
        self.acceptance.observe(tree, accepted)
        self.cost.refresh(len(tree), cached, seconds)

    def finish(self) -> None:
        """A request ended: keep the refreshed cost curve, where it can be kept."""
        save = getattr(self.cost, "save", None)
        if save is not None:
            save()


class WholeTree:
    """The budget of a fixed capacity: every drafted node is verified."""

    def select(self, tree: DraftTree, cached: int) -> DraftTree:
        return tree

    def observe(self, tree: DraftTree, accepted: Sequence[int], cached: int, seconds: float) -> None:
        pass

    def finish(self) -> None:
        pass
