"""What the requests of one memory scope share while they are drafted for: one n-gram
automaton over every prompt and accepted output they wrote, earlier and live, and one
copy-logit table of the model's predictions after each token, across them all.

RACER's own memory (``NgramAutomaton`` and ``CopyLogitTable`` in a drafter) follows one
request, or with ``memory=kept`` one lineage of requests handed the same drafter. With C
requests in flight a scope holds C lineages that never see each other's text, and a
request's first steps draft from nothing its lineage has not written. The shared memory
is read beside a request's own: its retrieval fills the tree after the request's own
(tagged with evidence keys of their own, so the acceptance model rates them apart and the
draft budget verifies them only where they pay), and its table answers the tokens whose
row the request has not written yet.

Why an Aho–Corasick automaton with LRU, as RACER's own, rather than a suffix tree over
whole responses (suffix decoding's global tree): it is bounded in nodes with a stated
eviction rule (the least recently used leaf), its matching state of a context is the
last n - 1 tokens' walk from the root (``NgramAutomaton.match``), so any number of live
requests read and write it with no per-request state inside it, and its candidates are
the same kind of nodes (continuations with frequencies and border depths) that RACER's
evidence keys and the draft budget already rate. Pure Python.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from racer.drafting.automaton import NgramAutomaton
from racer.drafting.copy_logit import CopyLogitTable


class SharedMemory:
    """A scope's shared automaton (``n``-grams, at most ``nodes`` nodes) and copy-logit
    table (rows of ``k`` ids, at most one per vocabulary token)."""

    def __init__(self, n: int = 10, nodes: int = 100_000, k: int = 8) -> None:
        self.automaton = NgramAutomaton(n, nodes)
        self.table = CopyLogitTable(k)
        self.writers = 0  # requests that have written here

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None, held: int = 0) -> None:
        """A request starts: its prompt's n-grams but those within its first ``held``
        tokens (text its drafter wrote here before), and the predictions over its last
        positions where it has them."""
        self.writers += 1
        if len(prompt) < self.automaton.n:
            self.automaton.insert(prompt)  # a short prompt is still text later requests may repeat
        else:
            self.automaton.insert_windows(prompt, held)
        if prompt_topk is not None and len(prompt_topk):
            self.table.write(prompt[len(prompt) - len(prompt_topk) :], prompt_topk)

    def extend(self, context: Sequence[int]) -> None:
        """A request's context grew by its last token (the n-gram ending there)."""
        n = self.automaton.n
        if len(context) >= n:
            self.automaton.insert(context[-n:])

    def write(self, tokens: Sequence[int], topk: np.ndarray) -> None:
        """The model's top ids after each of ``tokens`` (``CopyLogitTable.write``)."""
        self.table.write(tokens, topk)

    def state(self, context_tail: Sequence[int]) -> int:
        """The matching state of a context ending with ``context_tail``."""
        return self.automaton.match(context_tail[-(self.automaton.n - 1) :])

    def stats(self) -> dict:
        return {"nodes": self.automaton.live, "rows": len(self.table), "writers": self.writers,
                "evictions": self.automaton.evictions}
