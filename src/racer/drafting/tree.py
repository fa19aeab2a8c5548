"""Draft trees: what every drafter hands the engine. Pure Python/numpy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

# Where a drafted node came from, as bits: a node both sources proposed carries both.
RETRIEVAL = 1  # found in text: the context's n-grams, a datastore, a prompt lookup
LOGITS = 2  # the model's own earlier predictions (copy-logit rows, the last logits)
SOURCE_NAMES = ("none", "retrieval", "logits", "both")


def source_name(bits: int) -> str:
    """A node's provenance: "retrieval", "logits", "both", or "none" (no source: the
    root, the model's own token, or a drafter that does not say)."""
    return SOURCE_NAMES[bits & (RETRIEVAL | LOGITS)]


@dataclass(frozen=True)
class DraftTree:
    """A token tree flattened breadth-first: node 0 is the root (the token the engine
    will emit anyway); ``parents[i] < i`` for every other node."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[dict[int, int], ...] = field(repr=False)
    # Optional per-node provenance bits (RETRIEVAL, LOGITS): statistics and display only.
    sources: tuple[int, ...] | None = field(default=None, repr=False)
    # Optional per-node evidence key (hashable, e.g. ("logits", rank, depth)) that the
    # draft budget learns acceptance rates by; None: the node's depth is all it knows.
    features: tuple[Hashable, ...] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def child(self, node: int, token: int) -> int | None:
        return self.children[node].get(token)

    def ancestor_mask(self) -> np.ndarray:
        """(N, N) bool: row i is True at i's ancestors and i itself."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf paths of node indices."""
        return [self.path_to(i) for i in range(len(self.tokens)) if not self.children[i]]

    def subtree(self, nodes: Sequence[int]) -> "DraftTree":
        """The tree of ``nodes`` (ascending, root first, closed under parents), re-indexed.
        Ascending indices of a breadth-first tree stay breadth-first."""
        if len(nodes) == len(self.tokens):
            return self
        new_index = {old: new for new, old in enumerate(nodes)}
        if not nodes or nodes[0] != 0:
            raise ValueError("nodes: expected the root (node 0) first")
        parents = []
        for old in nodes:
            p = self.parents[old]
            if p >= 0 and p not in new_index:
                raise ValueError(f"nodes: node {old} is kept without its parent {p}")
            parents.append(new_index[p] if p >= 0 else -1)
        children: list[dict[int, int]] = [{} for _ in nodes]
        for new, p in enumerate(parents):
            if p >= 0:
                children[p][self.tokens[nodes[new]]] = new
        def pick(values: tuple | None) -> tuple | None:
            return None if values is None else tuple(values[i] for i in nodes)

        return DraftTree(tuple(self.tokens[i] for i in nodes), tuple(parents),
                         tuple(self.depths[i] for i in nodes), tuple(children), pick(self.sources),
                         pick(self.features))

    @staticmethod
    def single(root: int) -> "DraftTree":
        return DraftTree((int(root),), (-1,), (0,), ({},))


class TreeBuilder:
    """A trie under a fixed root with a node capacity (root included); shared prefixes
    merge. ``build()`` flattens it breadth-first."""

    def __init__(self, root: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 node (the root), got {capacity}")
        self.capacity = capacity
        self.tokens: list[int] = [int(root)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.sources: list[int] = [0]
        self.features: list[Hashable] = [None]
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.capacity

    def add_child(self, parent: int, token: int, source: int = 0, feature: Hashable = None) -> int | None:
        """Index of the child of ``parent`` carrying ``token``, created if needed; None
        when it would exceed the capacity. A node keeps the feature it was created
        with and gains the source bits of every proposal of it."""
        token = int(token)
        existing = self.children[parent].get(token)
        if existing is not None:
            self.sources[existing] |= source
            return existing
        if len(self.tokens) >= self.capacity:
            return None
        index = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.sources.append(source)
        self.features.append(feature)
        self.children.append({})
        self.children[parent][token] = index
        return index

    def add_path(self, tokens: Sequence[int], source: int | Sequence[int] = 0, parent: int = 0,
                 features: Sequence[Hashable] | None = None) -> int:
        """Add ``tokens`` below ``parent`` (the root by default), ``features[i]`` for
        the i-th, ``source`` for all of them or ``source[i]`` for each; returns how
        many nodes were created. Stops quietly at the capacity."""
        created = 0
        node: int | None = parent
        for i, token in enumerate(tokens):
            before = len(self.tokens)
            bits = source if isinstance(source, int) else source[i]
            node = self.add_child(node, token, bits, None if features is None else features[i])
            if node is None:
                break
            created += len(self.tokens) - before
        return created

    def build(self) -> DraftTree:
        n = len(self.tokens)
        order = sorted(range(n), key=self.depths.__getitem__)  # stable: BFS by depth
        if order == list(range(n)):
            return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.depths),
                             tuple(self.children), tuple(self.sources), tuple(self.features))
        new_index = [0] * n
        for new, old in enumerate(order):
            new_index[old] = new
        return DraftTree(
            tuple(self.tokens[o] for o in order),
            tuple(-1 if self.parents[o] < 0 else new_index[self.parents[o]] for o in order),
            tuple(self.depths[o] for o in order),
            tuple({t: new_index[c] for t, c in self.children[o].items()} for o in order),
            tuple(self.sources[o] for o in order),
            tuple(self.features[o] for o in order),
        )


def chain(root: int, tokens: Sequence[int], source: int = 0) -> DraftTree:
    """A single chain ``root, tokens...``, every draft node of provenance ``source``."""
    builder = TreeBuilder(root, len(tokens) + 1)
    builder.add_path(tokens, source)
    return builder.build()
