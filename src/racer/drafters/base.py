"""The drafter interface: the only thing a draft method implements.

A drafter is pure Python/numpy. The engine tells it the prompt (with the model's top-k
predictions at every prompt position, if it asks for them), asks it for a tree under a
node budget given the root token, and tells it what verification revealed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from racer.tree import DraftTree


class Drafter(ABC):
    #: How many top ids per position the drafter wants to be shown (0: none).
    topk: int = 0
    #: Whether it wants the top-k of every prompt position after prefill (costs the
    #: full-vocabulary logits over the prompt once per request).
    wants_prompt_topk: bool = False

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        """A new request. ``prompt_topk[i]`` are the top ids predicted after
        ``prompt[: i + 1]`` (None unless ``wants_prompt_topk``)."""

    @abstractmethod
    def draft(self, root: int, budget: int) -> DraftTree:
        """A tree whose node 0 is ``root`` (already emitted), at most ``budget`` nodes."""

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        """What verifying ``tree`` revealed: ``tree_topk[i]`` are the top ids predicted
        at node i (None unless ``topk``), ``accepted`` the accepted node indices from
        the root down. ``tree_topk[accepted[-1], 0]`` is the next root."""

    def request_stats(self) -> dict:
        """Drafter-specific counts for the current request (for records)."""
        return {}

    def describe(self) -> dict:
        """The drafter's name and options, for records and tables."""
        return {"method": getattr(self, "name", type(self).__name__)}


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same loop (a one-node tree)."""

    name = "none"

    def draft(self, root: int, budget: int) -> DraftTree:
        return DraftTree.single(root)
