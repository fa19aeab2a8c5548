"""Token Recycling (Luo et al., 2024): recycle the candidate tokens the model produced
while verifying, as a vocab x 8 adjacency table, and draft them through a static tree
template."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from racer.drafting.base import Drafter, Needs
from racer.drafting.copy_logit import CopyLogitTable, logits_feature
from racer.drafting.tree import LOGITS, DraftTree, TreeBuilder


def _parse_template(levels: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word is a node: its digits are the candidate ranks from the root down
    ("21": the 2nd candidate of the root's 3rd candidate, ranks 0-based)."""
    return tuple(tuple(int(d) for d in word) for level in levels for word in level.split())


# The authors' published template (root + 80 nodes; 8, 21, 25, 15, 8, 3 per level),
# breadth-first, so every node comes after its parent and a prefix is a valid tree.
TEMPLATE = _parse_template([
    "0 1 2 3 4 5 6 7",
    "00 01 02 03 04 05 06 07 10 11 12 13 20 21 22 30 31 40 50 60 70",
    "000 001 002 003 004 005 006 007 010 011 012 020 021 030 040 050 060 070 100 101 110 200 300 400 500",
    "0000 0001 0002 0003 0004 0010 0011 0020 0030 0040 0100 0200 1000 2000 3000",
    "00000 00001 00002 00010 00020 00100 01000 10000",
    "000000 000001 000100",
])
TEMPLATE_WIDTH = 1 + max(rank for path in TEMPLATE for rank in path)


class TokenRecyclingDrafter(Drafter):
    """Options (a fixed ``capacity`` of 81 is the original's whole template; fewer keeps
    the template's first nodes, which are its most probable ones):

    - ``prefill``: also fill the table from the prompt's logits (the original does not)
    - ``memory``: kept (the original: the table lives across requests) | fresh
    """

    name = "token-recycling"
    default_capacity = "auto"
    candidates = len(TEMPLATE) + 1

    def __init__(self, prefill: bool = False, memory: str = "kept") -> None:
        if memory not in ("kept", "fresh"):
            raise ValueError(f"token-recycling: memory: expected kept or fresh, got {memory!r}")
        self.prefill, self.memory = bool(prefill), memory
        self.needs = Needs(topk=TEMPLATE_WIDTH, prompt=self.prefill, prompt_rows="latest")
        self.table = CopyLogitTable(TEMPLATE_WIDTH)

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        if self.memory == "fresh":
            self.table = CopyLogitTable(TEMPLATE_WIDTH)
        if self.prefill and prompt_topk is not None:
            self.table.write(list(prompt)[len(prompt) - len(prompt_topk) :], prompt_topk)

    def draft(self, root: int, budget: int) -> DraftTree:
        builder = TreeBuilder(root, budget)
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for path in TEMPLATE:
            if builder.full:
                break
            parent = node_of.get(path[:-1])
            if parent is None:  # the parent's slot could not be filled
                continue
            row = self.table.row(builder.tokens[parent])
            if path[-1] < len(row):
                node_of[path] = builder.add_child(parent, row[path[-1]], LOGITS, logits_feature(path[-1], len(path)))
        return builder.build()

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        # Every verified node, accepted or not, rewrites its token's row (last write wins).
        if tree_topk is not None:
            self.table.write(tree.tokens, tree_topk)
