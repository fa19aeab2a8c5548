"""Choosing how much of a candidate tree to verify: the subtree that maximises expected
emitted tokens per unit of verification cost, and the online acceptance model that
gives every candidate node its probability. Pure Python (no torch).

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
from typing import Any, Callable, Protocol, Sequence

from racer.tree import DraftTree


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


def _fallback_key(depth: int) -> tuple:
    return ("depth", min(depth, 8))


def evidence_levels(key: Any) -> list:
    """A key's levels of evidence, coarse to fine: the prefixes of a tuple key
    (``("logits",)``, ``("logits", 0)``, ``("logits", 0, 3)``), else the key alone.
    Drafters order a key's elements from most to least telling."""
    if isinstance(key, tuple) and key:
        return [key[:j] for j in range(1, len(key) + 1)]
    return [key]


class AcceptanceModel:
    """Online estimate of P(node accepted | parent accepted) per evidence key.

    Each key (a node's ``feature``, or its depth when the drafter gives none) keeps
    accept/try counts from the steps already verified, and so does each coarser level
    of it (``evidence_levels``); a level with little evidence leans on the level above
    it, the coarsest on a uniform prior. So a key that deep trees seldom reach (a
    rank-0 copy-logit node at depth 3) starts from what its rank has shown at every
    depth, not from its source's average. Counts are halved past ``memory`` tries, so
    the estimate follows the current request rather than all history. Pure Python."""

    def __init__(self, strength: float = 4.0, memory: float = 400.0, seed: int = 0) -> None:
        if not strength > 0 or not memory > 0:
            raise ValueError(f"expected positive strength and memory, got {strength}, {memory}")
        self.strength, self.memory = strength, memory
        self.rng = random.Random(seed)
        self.counts: dict = {}  # key or level -> (accepted, tried)

    def _keys(self, tree: DraftTree) -> list:
        features = tree.features
        return [f if f is not None else _fallback_key(tree.depths[i])
                for i, f in enumerate(features if features is not None else [None] * len(tree))]

    def _posterior(self, key: Any) -> tuple[float, float]:
        """Beta parameters of a key's rate: its counts over the mean of the level above."""
        prior, a, b = 0.5, 1.0, 1.0
        for level in evidence_levels(key):
            h, t = self.counts.get(level, (0.0, 0.0))
            a, b = h + self.strength * prior, (t - h) + self.strength * (1.0 - prior)
            prior = a / (a + b)
        return a, b

    def estimate(self, key: Any) -> float:
        """Posterior mean rate of ``key``."""
        a, b = self._posterior(key)
        return a / (a + b)

    def probabilities(self, tree: DraftTree, explore: bool = False) -> list[float]:
        """Conditional acceptance probability of every node (the root's is 1).

        With ``explore``, each key's rate is drawn from its posterior (Thompson
        sampling, one draw per key per call): a key that a few unlucky early steps made
        look bad still gets verified now and then, while one with plenty of evidence
        stays near its mean. Without it, verified trees would freeze on first
        impressions (a cold copy-logit table rejects everything at first).

        Siblings are not renormalised: a key's rate is measured over the sibling sets
        it occurs in, so the rates of one node's children sum to its expected accepted
        children."""
        keys = self._keys(tree)
        if not explore:
            return [1.0] + [self.estimate(keys[i]) for i in range(1, len(tree))]
        drawn: dict = {}
        out = [1.0]
        for key in keys[1:]:
            p = drawn.get(key)
            if p is None:
                p = drawn[key] = self.rng.betavariate(*self._posterior(key))
            out.append(p)
        return out

    def observe(self, tree: DraftTree, accepted: Sequence[int]) -> None:
        """Count every node whose parent was accepted: a try, and a hit if accepted too."""
        on_path = set(accepted)
        keys = self._keys(tree)
        counts, memory = self.counts, self.memory
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                hit = 1.0 if i in on_path else 0.0
                for level in evidence_levels(keys[i]):
                    h, t = counts.get(level, (0.0, 0.0))
                    h, t = h + hit, t + 1.0
                    if t > memory:
                        h, t = h / 2, t / 2
                    counts[level] = (h, t)


class CostCurve(Protocol):
    """What the budget needs of a step-cost model (``racer.cost.CostModel`` is one). A
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
