"""REST (He et al., 2023): retrieve what followed the context's longest suffix in a
datastore, and draft the most frequent continuation prefixes as a tree."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from racer.drafting.base import Drafter
from racer.drafting.datastore import SEPARATOR, Datastore
from racer.drafting.tree import RETRIEVAL, DraftTree, TreeBuilder


def top_prefixes(continuations: np.ndarray, k: int) -> list[tuple[int, ...]]:
    """The ``k`` most frequent prefixes among the rows of ``continuations`` (counted once
    per row; SEPARATOR ends a row). Ties go to the shorter prefix, then to the
    lexicographically smaller one, so every chosen prefix's parent is chosen before it."""
    if k <= 0 or not len(continuations):
        return []
    rows = continuations[np.lexsort(continuations.T[::-1])]
    m, depth = rows.shape
    changed = np.ones((m, depth), dtype=bool)
    changed[1:] = rows[1:] != rows[:-1]
    starts_here = np.logical_or.accumulate(changed, axis=1)  # row i begins a new prefix of length d+1
    valid = np.logical_and.accumulate(rows != SEPARATOR, axis=1)
    counts, lengths, firsts = [], [], []
    for d in range(depth):
        starts = np.flatnonzero(starts_here[:, d])
        runs = np.diff(np.append(starts, m))
        keep = valid[starts, d]
        counts.append(runs[keep])
        lengths.append(np.full(int(keep.sum()), d + 1))
        firsts.append(starts[keep])
    count, length, first = (np.concatenate(a) for a in (counts, lengths, firsts))
    order = np.lexsort((first, length, -count))[:k]  # rows are sorted, so `first` orders lexicographically
    return [tuple(rows[first[i], : length[i]].tolist()) for i in order]


class RestDrafter(Drafter):
    """Options (a fixed ``capacity`` of 65, 64 draft tokens + root, is the original's):

    - ``datastore``: the folder written by ``racer datastore build`` (required)
    - ``max_suffix`` (16) / ``min_suffix`` (2): suffix lengths tried, longest first
    - ``occurrences``: matches collected at most (5000); ``length``: tokens taken after each (10)
    """

    name = "rest"
    default_capacity = "auto"
    candidates = 65

    def __init__(self, datastore: str = "", max_suffix: int = 16, min_suffix: int = 2, occurrences: int = 5000,
                 length: int = 10) -> None:
        if not datastore:
            raise ValueError("rest: datastore: expected the folder written by 'racer datastore build', "
                             "e.g. rest:datastore=PATH")
        for option, value in (("max_suffix", max_suffix), ("min_suffix", min_suffix),
                              ("occurrences", occurrences), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"rest: {option}: expected a positive integer, got {value!r}")
        if min_suffix > max_suffix:
            raise ValueError(f"rest: expected min_suffix <= max_suffix, got {min_suffix} > {max_suffix}")
        self.store = Datastore(str(datastore))
        self.datastore, self.max_suffix, self.min_suffix = str(self.store.folder), max_suffix, min_suffix
        self.occurrences, self.length = occurrences, length
        self._tail: list[int] = []
        self.matched: list[int] = []  # per step: suffix length that hit (0: none)

    def attach(self, tokenizer: Any, end_ids: set[int]) -> None:
        if tokenizer is not None:
            self.store.check_tokenizer(tokenizer)

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self._tail = [int(t) for t in prompt[-self.max_suffix :]]
        self.matched = []

    def retrieve(self, context: Sequence[int], k: int) -> list[tuple[int, ...]]:
        """Top-``k`` continuation prefixes after the longest suffix of ``context``
        (``max_suffix`` down to ``min_suffix`` tokens) found in the datastore."""
        # If the last n tokens occur, so do the last n - 1: the longest suffix with a
        # hit (what trying 16, 15, ... 2 in turn finds) can be bisected for.
        shortest, longest = self.min_suffix, min(self.max_suffix, len(context))
        best: tuple[int, int, int] | None = None
        while shortest <= longest:
            n = (shortest + longest) // 2
            lo, hi = self.store.find(context[-n:])
            if hi > lo:
                best, shortest = (n, lo, hi), n + 1
            else:
                longest = n - 1
        if best is None:
            self.matched.append(0)
            return []
        n, lo, hi = best
        self.matched.append(n)
        found = self.store.continuations(lo, min(hi, lo + self.occurrences), n, self.length)
        return top_prefixes(found, k)

    def draft(self, root: int, budget: int) -> DraftTree:
        builder = TreeBuilder(root, budget)
        if budget > 1:
            for order, prefix in enumerate(self.retrieve(self._tail + [root], budget - 1)):
                # Prefixes come most frequent first: their order is the evidence.
                tier = min((order + 1).bit_length(), 6)
                builder.add_path(prefix, RETRIEVAL, features=[("datastore", tier, min(d, 4)) for d in range(1, len(prefix) + 1)])
        return builder.build()

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        self._tail.extend(tree.tokens[i] for i in accepted)
        del self._tail[: -self.max_suffix]

    def request_stats(self) -> dict:
        hits = [n for n in self.matched if n]
        return {"retrieval_hit_share": round(len(hits) / len(self.matched), 4) if self.matched else 0.0,
                "mean_suffix": round(sum(hits) / len(hits), 2) if hits else 0.0}
