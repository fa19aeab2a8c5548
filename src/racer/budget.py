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

from typing import Callable, Sequence


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
    emitted tokens / ``cost(size)``, and that ratio. Ties go to the smaller tree."""
    probs = path_probabilities(parents, accept)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    # Most probable first; on ties shallower, then earlier: a parent always precedes its child.
    order = sorted(range(1, len(parents)), key=lambda i: (-probs[i], depth[i], i))
    best_size, best_rate, expected = 1, 1.0 / _checked(cost, 1), 1.0
    for size, node in enumerate(order, start=2):
        expected += probs[node]
        rate = expected / _checked(cost, size)
        if rate > best_rate:
            best_size, best_rate = size, rate
    return sorted([0] + order[: best_size - 1]), best_rate


def _checked(cost: Callable[[int], float], size: int) -> float:
    value = float(cost(size))
    if not value > 0:
        raise ValueError(f"cost: expected a positive time for {size} nodes, got {value}")
    return value
