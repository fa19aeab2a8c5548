"""The drafter interface: the only thing a draft method implements.

A drafter is pure Python/numpy. The engine tells it the prompt (with the model's top-k
predictions where its ``needs`` ask for them), asks it for a tree of at most ``budget``
nodes under a root token, and tells it what verification revealed. How many nodes are
verified (a fixed capacity, or the draft budget's choice) is decided outside it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from racer.drafting.tree import DraftTree

_AT = ("tree", "last")
_PROMPT_ROWS = ("every", "latest")


@dataclass(frozen=True)
class Needs:
    """What a drafter needs to see of the model's predictions.

    ``topk``: how many top ids per position (0: none). ``at``: of which verified nodes,
    "tree" (every node) or "last" (only the last accepted one, all a drafter driven by
    the last logits needs). ``prompt``: also at the prompt's positions after prefill
    (its last ones: the full-vocabulary logits cost a pass's LM head per position);
    without it, a drafter with ``topk`` sees one row, the prediction after the whole
    prompt. ``prompt_rows``: "every" prompt position's row, or "latest": only the rows
    at each input token's most recent position are read (a table keyed by the token in
    which later rows overwrite earlier ones, as ``CopyLogitTable``), so the engine
    computes only those and the others hold -1."""

    topk: int = 0
    at: str = "tree"
    prompt: bool = False
    prompt_rows: str = "every"

    def __post_init__(self) -> None:
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 0:
            raise ValueError(f"needs: topk: expected 0 or a positive integer, got {self.topk!r}")
        if self.at not in _AT:
            raise ValueError(f"needs: at: expected one of {', '.join(_AT)}, got {self.at!r}")
        if self.prompt and not self.topk:
            raise ValueError("needs: prompt top-k asked for with topk=0")
        if self.prompt_rows not in _PROMPT_ROWS:
            raise ValueError(f"needs: prompt_rows: expected one of {', '.join(_PROMPT_ROWS)}, "
                             f"got {self.prompt_rows!r}")


class Drafter(ABC):
    """A draft method. Subclasses set ``name``, ``needs``, ``candidates`` (the most nodes
    it proposes, root included: the tree asked for when the draft budget chooses the
    size, and the default fixed capacity) and ``default_capacity``, and keep each
    constructor option under its own name, which is what ``describe`` reports."""

    name: str = ""
    needs: Needs = Needs()
    candidates: int = 64
    #: "auto": the draft budget chooses how much of each candidate tree to verify;
    #: None: verify every node proposed (a fixed capacity of ``candidates``).
    default_capacity: str | None = None

    def attach(self, tokenizer: Any, end_ids: set[int]) -> None:
        """The model this drafter will draft for, told once by the engine: its tokenizer
        (may be None) and end-of-sequence ids. Drafters whose data depend on the
        tokenizer check it here."""

    def new_shared(self) -> Any:
        """A new memory for the requests of one scope to share (a drafter's own kind:
        RACER's is ``racer.drafting.shared.SharedMemory``), or None: this drafter, as
        configured, shares nothing beyond what it keeps itself."""
        return None

    def share(self, shared: Any) -> None:
        """The shared memory (one ``new_shared`` made) of the scope of the request about
        to ``begin``, or None: that request shares nothing."""

    def holds(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` this drafter has learnt already, as the
        text of the last request it served (that request's prompt and answer), which its
        ``begin`` then need not learn again: an agent or a chat client resends its whole
        conversation on every call. 0: it keeps nothing of a request's text that way."""
        return 0

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        """A new request. With ``needs.prompt``, ``prompt_topk`` holds the top ids
        predicted at the prompt's last positions (the engine's ``prompt_window`` of them,
        or all): row ``i`` after ``prompt[: len(prompt) - len(prompt_topk) + i + 1]``
        (with ``needs.prompt_rows == "latest"``, -1 where that is not its token's
        latest position); otherwise one row, the prediction after the whole prompt;
        None when ``needs.topk`` is 0."""

    @abstractmethod
    def draft(self, root: int, budget: int) -> DraftTree:
        """A tree whose node 0 is ``root`` (already emitted), at most ``budget`` nodes."""

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        """What verifying ``tree`` revealed: ``accepted`` are the accepted node indices
        from the root down; ``tree_topk[i]`` are the top ids predicted at node i (None
        unless ``needs.topk``), or with ``needs.at == "last"`` a single row, the
        prediction at ``accepted[-1]``. In greedy decoding that row's first id is the
        next root."""

    def request_stats(self) -> dict:
        """Drafter-specific counts for the current request (for records)."""
        return {}

    def describe(self) -> dict:
        """The drafter's name and options (each constructor parameter's current value)."""
        params = inspect.signature(type(self).__init__).parameters
        options = {p: getattr(self, p) for p in params if p != "self" and hasattr(self, p)}
        return {"method": self.name or type(self).__name__, **options}


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same loop (a one-node tree)."""

    name = "none"
    candidates = 1

    def draft(self, root: int, budget: int) -> DraftTree:
        return DraftTree.single(root)
