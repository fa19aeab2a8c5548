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
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

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


def ranked(parents: Sequence[int], accept: Sequence[float]) -> tuple[list[int], list[float]]:
    """The draft nodes most probable first (on ties shallower, then earlier, so a parent
    always precedes its child), and the expected emitted tokens of the best subtree of
    each size 1..len(parents): the root plus the first n - 1 of them. The one ranking
    every budget uses."""
    probs = path_probabilities(parents, accept)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(1, len(parents)), key=lambda i: (-probs[i], depth[i], i))
    expected = [1.0]
    for node in order:
        expected.append(expected[-1] + probs[node])
    return order, expected


def best_subtree(parents: Sequence[int], accept: Sequence[float],
                 cost: Callable[[int], float]) -> tuple[list[int], float]:
    """The node indices (ascending, root first) of the subtree that maximises expected
    emitted tokens / ``cost(size)``, and that ratio. Ties go to the smaller tree, except
    where the larger one costs the same: a node that costs nothing is kept, so a flat
    (GPU-like) curve verifies the whole candidate tree, even nodes whose path
    probability is too small to change the sum in floating point."""
    order, expected = ranked(parents, accept)
    best_cost = _checked(cost, 1)
    best_size, best_rate = 1, 1.0 / best_cost
    for size in range(2, len(expected) + 1):
        seconds = _checked(cost, size)
        rate = expected[size - 1] / seconds
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


@dataclass
class StepTiming:
    """What one step of the engine verified and how long it took: the trees (one per
    row), the cache lengths they were verified on, the pass's seconds, the whole step's
    (drafting, the pass, acceptance, the drafters' updates), and drafting's share
    (None: the step drafted nothing)."""

    trees: Sequence[DraftTree]
    lengths: Sequence[int]
    pass_s: float
    step_s: float
    drafting_s: float | None


class Budget(Protocol):
    """How much of each row's candidate tree a step verifies; the engine asks it once
    per step, in this order. ``packed``: the engine's passes lay the rows' trees one
    after another (a node costs the same whichever row holds it) rather than padding
    each to the largest; the engine keeps it current."""

    packed: bool

    def drafts(self) -> bool:
        """Whether the step about to run drafts at all (False: bare roots)."""

    def ask(self, size: int) -> int:
        """How many candidate nodes to ask each drafter for, at most ``size``."""

    def select(self, trees: Sequence[DraftTree], acceptances: Sequence[Any],
               lengths: Sequence[int]) -> list[DraftTree]:
        """The part of each row's candidate tree to verify (``acceptances``: each row's
        acceptance model, None where the method has a fixed capacity)."""

    def observe(self, step: StepTiming) -> None:
        """What the step cost."""


class WholeTree:
    """The budget of a fixed capacity: every drafted node is verified."""

    packed = False

    def drafts(self) -> bool:
        return True

    def ask(self, size: int) -> int:
        return size

    def select(self, trees: Sequence[DraftTree], acceptances: Sequence[Any],
               lengths: Sequence[int]) -> list[DraftTree]:
        return list(trees)

    def observe(self, step: StepTiming) -> None:
        pass


class DraftBudget(WholeTree):
    """The budget of one row, per node: keep the part of the drafter's candidate tree
    that maximises expected emitted tokens per second, from a cost curve read per tree
    size and the row's acceptance model (each key's rate drawn from its posterior: a
    lone request explores, see ``AcceptanceModel.probabilities``)."""

    def __init__(self, cost: CostCurve, seed: int = 0) -> None:
        self.cost = cost
        self.rng = random.Random(seed)

    def select(self, trees: Sequence[DraftTree], acceptances: Sequence[AcceptanceModel],
               lengths: Sequence[int]) -> list[DraftTree]:
        if len(trees) != 1:
            raise ValueError(f"DraftBudget: chooses for one row, got {len(trees)}")
        tree, cached = trees[0], lengths[0]
        if len(tree) == 1:
            return [tree]
        probs = acceptances[0].probabilities(tree, explore=True)
        draw = getattr(self.cost, "draw", None)
        predict = draw(self.rng) if draw is not None else self.cost.predict
        nodes, _ = best_subtree(tree.parents, probs, lambda n: predict(n, cached))
        return [tree.subtree(nodes)]

    def observe(self, step: StepTiming) -> None:
        self.cost.refresh(len(step.trees[0]), step.lengths[0], step.step_s)
