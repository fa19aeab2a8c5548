"""Prompt lookup decoding (PLD): match the last n tokens against earlier context and
propose what followed, as a single chain."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from racer.drafting.base import Drafter
from racer.drafting.tree import RETRIEVAL, DraftTree, chain

# variant: (max_ngram, where a continuation may start, what to do at an end token)
_VARIANTS = {
    # Saxena's original (and the RACER paper's PLD run): n = 3..1; the continuation must
    # start before the matched suffix does. An end token ends the draft (kept: the
    # model may accept it, and nothing after it can matter).
    "original": (3, "before_suffix", "keep"),
    # Hugging Face's PromptLookupCandidateGenerator: n = 2..1; any earlier match with at
    # least one token after it (it may run into the suffix); drafts are cut *before*
    # an end token.
    "hf": (2, "anywhere", "cut"),
}


class PromptLookupDrafter(Drafter):
    """PLD. ``variant`` = original | hf sets the matching rule and the default
    ``max_ngram`` (3 | 2); n-gram sizes run from ``max_ngram`` down to ``min_ngram``;
    the leftmost (earliest) match that has a continuation wins; up to ``num_tokens``."""

    name = "pld"

    def __init__(self, variant: str = "original", max_ngram: int | None = None, num_tokens: int = 10,
                 min_ngram: int = 1) -> None:
        if variant not in _VARIANTS:
            raise ValueError(f"pld: variant: expected one of {', '.join(_VARIANTS)}, got {variant!r}")
        default_ngram, self.start_rule, self.end_rule = _VARIANTS[variant]
        max_ngram = default_ngram if max_ngram is None else max_ngram
        if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"pld: expected integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"pld: num_tokens: expected at least 1, got {num_tokens}")
        self.variant = variant
        self.max_ngram, self.num_tokens, self.min_ngram = max_ngram, num_tokens, min_ngram
        self.candidates = num_tokens + 1
        self.end_ids: set[int] = set()
        self._buf = np.zeros(1024, dtype=np.int64)
        self._len = 0

    def attach(self, tokenizer: Any, end_ids: set[int]) -> None:
        self.end_ids = set(end_ids)

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
            # Candidate match starts: "before_suffix" needs start + n < length - n;
            # "anywhere" needs start + n < length (one token after the match).
            count = length - 2 * n if self.start_rule == "before_suffix" else length - n
            if count <= 0:
                continue
            hits = np.ones(count, dtype=bool)
            for j in range(n):
                hits &= context[j : count + j] == suffix[j]
            starts = np.flatnonzero(hits)
            if len(starts):
                begin = starts[0] + n
                return self._cut_at_end(context[begin : begin + self.num_tokens])
        return context[:0]

    def _cut_at_end(self, proposal: np.ndarray) -> np.ndarray:
        if not self.end_ids:
            return proposal
        ends = np.flatnonzero(np.isin(proposal, list(self.end_ids)))
        if not len(ends):
            return proposal
        return proposal[: ends[0] + (1 if self.end_rule == "keep" else 0)]

    def draft(self, root: int, budget: int) -> DraftTree:
        self._buf[self._len] = root  # the root ends the context but is not committed yet
        proposal = self.lookup(self._buf[: self._len + 1])
        return chain(root, proposal[: max(0, budget - 1)].tolist(), RETRIEVAL)

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        self._append([tree.tokens[i] for i in accepted])
