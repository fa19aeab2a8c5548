"""Prompt lookup decoding (PLD): match the last n tokens against earlier context and
propose what followed, as a single chain."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from racer.drafters.base import Drafter
from racer.tree import DraftTree, chain


class PromptLookupDrafter(Drafter):
    """Original PLD: n-gram sizes ``max_ngram`` down to ``min_ngram``; the leftmost
    (earliest) match that has a continuation wins; up to ``num_tokens`` tokens."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, num_tokens: int = 10, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"pld: expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1:
            raise ValueError(f"pld: num_tokens: expected at least 1, got {num_tokens}")
        self.max_ngram, self.num_tokens, self.min_ngram = max_ngram, num_tokens, min_ngram
        self._buf = np.zeros(1024, dtype=np.int64)
        self._len = 0

    def describe(self) -> dict:
        return {"method": self.name, "max_ngram": self.max_ngram, "num_tokens": self.num_tokens,
                "min_ngram": self.min_ngram}

    def _append(self, tokens: Sequence[int]) -> None:
        need = self._len + len(tokens) + 1
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + len(tokens)] = tokens
        self._len += len(tokens)

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self._len = 0
        self._append(prompt)

    def lookup(self, context: np.ndarray) -> np.ndarray:
        """The continuation proposed for ``context`` (possibly empty)."""
        length = len(context)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            suffix = context[length - n :]
            # As the original: the continuation must start before the suffix does
            # (match start + n < length - n).
            count = length - 2 * n
            if count <= 0:
                continue
            hits = np.ones(count, dtype=bool)
            for j in range(n):
                hits &= context[j : count + j] == suffix[j]
            starts = np.flatnonzero(hits)
            if len(starts):
                begin = starts[0] + n
                return context[begin : begin + self.num_tokens]
        return context[:0]

    def draft(self, root: int, budget: int) -> DraftTree:
        self._buf[self._len] = root  # the root ends the context but is not committed yet
        proposal = self.lookup(self._buf[: self._len + 1])
        return chain(root, proposal[: max(0, budget - 1)].tolist())

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        self._append([tree.tokens[i] for i in accepted])
