"""LogitSpec (Liu et al., 2025): the last logits guess the next-next token; each guess
and the root itself retrieve a continuation from an n-gram index of the context."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from racer.drafting.base import Drafter, Needs
from racer.drafting.tree import LOGITS, RETRIEVAL, DraftTree, TreeBuilder


def tokens_kept(rank: int) -> int:
    """How many tokens a guess of this rank (1 = best guess after the root) keeps:
    itself plus what it retrieved."""
    return 4 if rank <= 8 else 3 if rank <= 32 else 1


class NgramIndex:
    """For n = 1..``max_n``: n-gram -> the up-to-``length`` tokens that followed its most
    recent occurrence. A new occurrence replaces the entry only when its continuation
    is at least as long (so a fresh match near the end does not wipe a full one)."""

    def __init__(self, max_n: int = 3, length: int = 20) -> None:
        self.max_n, self.length = max_n, length
        self.maps: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n)]
        self.context: list[int] = []

    def _scan(self, start: int) -> None:
        ctx, size = self.context, len(self.context)
        for i in range(max(0, start), size):
            for n in range(1, self.max_n + 1):
                end = i + n
                if end >= size:
                    break
                key = tuple(ctx[i:end])
                follow = ctx[end : end + self.length]
                table = self.maps[n - 1]
                old = table.get(key)
                if old is None or len(follow) >= len(old):
                    table[key] = follow

    def reset(self, context: Sequence[int]) -> None:
        self.maps = [{} for _ in range(self.max_n)]
        self.context = [int(t) for t in context]
        self._scan(0)

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(int(t) for t in tokens)
        # Entries within the last 2 x length positions may have grown; rescan them.
        self._scan(len(self.context) - 2 * self.length)

    def lookup(self, tail: Sequence[int]) -> list[int]:
        """The continuation of the longest indexed suffix of ``tail`` (n = max_n..1)."""
        for n in range(min(self.max_n, len(tail)), 0, -1):
            hit = self.maps[n - 1].get(tuple(tail[-n:]))
            if hit is not None:
                return hit
        return []


class LogitSpecDrafter(Drafter):
    """Options (a fixed ``capacity`` of 64 is the original's):

    - ``guesses``: next-next-token guesses come from the top-``guesses`` of the last
      logits, minus the root (64)
    - ``max_ngram`` (3), ``length`` (20): the context index
    - ``merge``: shared prefixes merge and the capacity counts tree nodes (default);
      false counts every proposed token as the original's separate chains do (the
      merged tree accepts exactly what those chains accept)
    """

    name = "logitspec"
    default_capacity = "auto"
    candidates = 64

    def __init__(self, guesses: int = 64, max_ngram: int = 3, length: int = 20, merge: bool = True) -> None:
        for option, value in (("guesses", guesses), ("max_ngram", max_ngram),
                              ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"logitspec: {option}: expected a positive integer, got {value!r}")
        self.guesses, self.max_ngram, self.length, self.merge = guesses, max_ngram, length, bool(merge)
        self.needs = Needs(topk=guesses, at="last")
        self.index = NgramIndex(max_ngram, length)
        self._last_row: list[int] = []

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.index.reset(prompt)
        self._last_row = prompt_topk[-1].tolist() if prompt_topk is not None else []

    def draft(self, root: int, budget: int) -> DraftTree:
        builder = TreeBuilder(root, budget)
        room = budget - 1  # draft tokens allowed besides the root
        tail = self.index.context[-self.index.max_n :] + [root]
        proposed = 0

        def full() -> bool:
            return builder.full if self.merge else proposed >= room

        root_chain = self.index.lookup(tail)[:room]
        builder.add_path(root_chain, RETRIEVAL,
                         features=[("context", min(d, 4)) for d in range(1, len(root_chain) + 1)])
        proposed += len(root_chain)
        rank = 0
        for guess in self._last_row:
            if full():
                break
            if guess == root:
                continue
            rank += 1
            chain = ([guess] + self.index.lookup(tail[1:] + [guess]))[: tokens_kept(rank)]
            if not self.merge:
                chain = chain[: room - proposed]
            tier = min(rank.bit_length(), 6)  # ranks 1, 2-3, 4-7, ... 32+
            builder.add_path(chain, [LOGITS] + [RETRIEVAL] * (len(chain) - 1),
                             features=[("guess", tier)] + [("guess-context", min(d, 3)) for d in range(1, len(chain))])
            proposed += len(chain)
        return builder.build()

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        self.index.extend([tree.tokens[i] for i in accepted])
        if tree_topk is not None:
            self._last_row = tree_topk[-1].tolist()
