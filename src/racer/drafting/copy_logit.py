"""RACER's copy-logit source: a table of the model's own earlier predictions, grown
into the paper's "Logits Tree" breadth-first with halving breadths."""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import numpy as np

from racer.drafting.tree import LOGITS, TreeBuilder


def logits_feature(rank: int, depth: int) -> tuple:
    """Acceptance evidence of a node taken from a copy-logit row: its rank there
    (0-based) and its depth (3 = 3 or deeper)."""
    return ("logits", rank, min(depth, 3))


class CopyLogitTable:
    """``row(v)``: the top-k ids predicted at the most recent position whose input
    token was ``v``. Rows never written propose nothing (the reference drafts token 0)."""

    def __init__(self, k: int = 8) -> None:
        if k < 1:
            raise ValueError(f"k: expected a breadth of at least 1, got {k}")
        self.k = k
        self.rows: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, token: int) -> tuple[int, ...]:
        return self.rows.get(token, ())

    def write(self, tokens: Sequence[int], topk: np.ndarray) -> None:
        """Row ``tokens[i]`` := ``topk[i, :k]``; later entries overwrite earlier ones.
        A row of -1 (a prediction not computed: ``Needs.prompt_rows``) writes nothing."""
        rows = self.rows
        for token, ids in zip(tokens, topk[:, : self.k].tolist()):
            if ids and ids[0] >= 0:
                rows[int(token)] = tuple(ids)


def child_breadth(breadth: int, rank: int, parent_depth: int) -> int:
    """The paper's b_child = max(1, b >> (j + s)), s = 0 below a depth-1 node, else 1:
    the root's children fan out 4, 2, 1, ...; depth-1 nodes keep their breadth for
    their first child; deeper nodes halve."""
    shift = rank + (0 if parent_depth == 1 else 1)
    return max(1, breadth >> shift)


def expand_logits_tree(builder: TreeBuilder, candidates: Callable[[int], Sequence[int]], k: int, budget: int,
                       feature: Callable[[int, int, int], tuple] | None = None) -> int:
    """Grow ``builder`` breadth-first from its root: node u with breadth b gets the
    first b ids of ``candidates(u_token)`` as children. At most ``budget`` proposals
    (counted whether or not they merge with nodes already there); returns how many.
    ``feature(parent_token, rank, depth)``: a node's evidence key (default
    ``logits_feature``)."""
    proposed = 0
    queue = deque([(0, k)])
    while queue and proposed < budget:
        node, breadth = queue.popleft()
        depth = builder.depths[node]
        for rank, token in enumerate(candidates(builder.tokens[node])[:breadth]):
            if proposed >= budget:
                break
            key = (logits_feature(rank, depth + 1) if feature is None
                   else feature(builder.tokens[node], rank, depth + 1))
            child = builder.add_child(node, token, LOGITS, key)
            if child is None:
                return proposed
            proposed += 1
            queue.append((child, child_breadth(breadth, rank, depth)))
    return proposed
