"""The drafter interface: the only thing a draft method implements.

A drafter is pure Python/numpy. The engine tells it the prompt (with the model's top-k
predictions at every prompt position, if it asks for them), asks it for a tree under a
node budget given the root token, and tells it what verification revealed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from racer.tree import DraftTree


class Drafter(ABC):
    #: How many top ids per position the drafter wants to be shown (0: none).
    topk: int = 0
    #: Whether it wants the top-k of every prompt position after prefill (costs the
    #: full-vocabulary logits over the prompt once per request).
    wants_prompt_topk: bool = False
    #: Which verified nodes it wants top-k ids of: "tree" (every node) or "last" (only
    #: the last accepted one, which is all a drafter driven by the last logits needs).
    topk_nodes: str = "tree"
    #: True when the drafter's capacity is "auto": it proposes a generous candidate
    #: tree and the engine's draft budget keeps the part worth verifying.
    auto_capacity: bool = False
    #: False for a drafter that never proposes more than the root (plain decoding).
    drafts: bool = True

    def attach(self, tokenizer: Any, end_ids: set[int]) -> None:
        """The model this drafter will draft for, told once by the engine: its tokenizer
        (may be None) and end-of-sequence ids. Drafters whose data depend on the
        tokenizer check it here."""

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        """A new request. With ``wants_prompt_topk``, ``prompt_topk[i]`` are the top ids
        predicted after ``prompt[: i + 1]``; otherwise, when ``topk`` > 0, it holds one
        row, the prediction after the whole prompt; None when ``topk`` is 0."""

    @abstractmethod
    def draft(self, root: int, budget: int) -> DraftTree:
        """A tree whose node 0 is ``root`` (already emitted), at most ``budget`` nodes."""

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        """What verifying ``tree`` revealed: ``accepted`` are the accepted node indices
        from the root down; ``tree_topk[i]`` are the top ids predicted at node i (None
        unless ``topk``), or with ``topk_nodes == "last"`` a single row, the prediction
        at ``accepted[-1]``. In greedy decoding that row's first id is the next root."""

    def request_stats(self) -> dict:
        """Drafter-specific counts for the current request (for records)."""
        return {}

    def describe(self) -> dict:
        """The drafter's name and options, for records and tables."""
        return {"method": getattr(self, "name", type(self).__name__)}


def parse_capacity(method: str, value: Any, generous: int) -> tuple[int, bool]:
    """``capacity`` option: "auto" (candidate trees of ``generous`` nodes, trimmed each
    step by the draft budget) or a fixed node count, root included. Returns the
    candidate capacity and whether it is auto."""
    if value == "auto":
        return generous, True
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{method}: capacity: expected 'auto' or a node count of at least 1, got {value!r}")
    return value, False


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same loop (a one-node tree)."""

    drafts = False

    name = "none"

    def draft(self, root: int, budget: int) -> DraftTree:
        return DraftTree.single(root)
