"""How likely each candidate node is to be accepted: an online estimate per evidence key
that the drafters tag their nodes with. Pure Python (no torch)."""

from __future__ import annotations

import random
from typing import Any, Sequence

from racer.drafting.tree import DraftTree


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
