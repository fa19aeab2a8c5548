"""RACER: retrieval (seen patterns) first, then the copy-logit Logits Tree (unseen
continuations) in the capacity left, merged into one draft tree."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import numpy as np

from racer.drafting.automaton import Continuation, NgramAutomaton
from racer.drafting.base import Drafter, Needs
from racer.drafting.context_match import ContextMatch
from racer.drafting.copy_logit import CopyLogitTable, expand_logits_tree, logits_feature
from racer.drafting.shared import SharedMemory
from racer.drafting.tree import LOGITS, RETRIEVAL, DraftTree, TreeBuilder, source_name


def retrieval_feature(agreement: int, border_depth: int, ratio: float) -> tuple:
    """Acceptance evidence of a retrieved node, most telling first (the draft budget
    backs off along this order): whether the model's own earlier prediction after the
    parent token agrees (1: rank 1 of its copy-logit row, 2: lower in the row, 0: not in
    it; ``python -m racer.bench.measure evidence`` counts how often each is right), how
    long the context match behind it is, and how often its trie parent continued with
    it (freq ratio, in quarters)."""
    return ("retrieval", agreement, min(border_depth, 6), min(int(ratio * 4), 4))


def context_feature(matched: int, agreement: int) -> tuple:
    """A node of the deep chain (``racer.drafting.context_match``): how many context
    tokens match behind its parent (the match found, plus the chain's tokens above it),
    in powers of two up to 64, and whether the parent's copy-logit row agrees (as in
    ``retrieval_feature``)."""
    return ("context", min(matched.bit_length(), 7), agreement)


def shared_feature(agreement: int, border_depth: int, ratio: float) -> tuple:
    """A node retrieved from the scope's shared automaton: the same evidence as
    ``retrieval_feature`` under a key of its own, since other requests' text is rated
    apart from the request's own."""
    return ("shared",) + retrieval_feature(agreement, border_depth, ratio)[1:]


def shared_logits_feature(rank: int, depth: int) -> tuple:
    """A node from a row of the shared copy-logit table (another request wrote it)."""
    return ("shared-logits",) + logits_feature(rank, depth)[1:]


_SHARED_KEYS = ("shared", "shared-logits")  # the evidence keys' first element for shared drafts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: a binary search over slice
    comparisons, which run in C."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


_CHOICES = {
    "sources": ("both", "retrieval", "logits"),
    "logits": ("copy", "last"),
    "update": ("all", "accepted"),
    "memory": ("kept", "fresh", "shared", "kept-shared"),
}


class RacerDrafter(Drafter):
    """Options (reference behaviour as defaults):

    - ``n``: n-gram length of the retrieval automaton (10); ``nodes``: its node capacity (10,000)
    - ``k``: copy-logit row width and root breadth (8)
    - ``min_border``: shortest suffix match that retrieval uses (2)
    - ``deep``: the longest chain drafted first from the context's longest earlier match
      of at least ``min_border + 1`` tokens (``racer.drafting.context_match``; 32; 0:
      none, the paper's tree)
    - ``chain``: draft a single path instead of a tree
    - ``sources``: both | retrieval | logits (the paper's ablation)
    - ``logits``: copy (row of the token's last occurrence) | last (reuse the last step's logits)
    - ``update``: all verified nodes write the table | accepted nodes only
    - ``memory``: kept across requests (one lineage of requests, the drafter's) | fresh
      per request (the paper's) | shared: fresh per request, with the scope's shared
      memory read beside it (``racer.drafting.shared``; ``shared_nodes`` bounds its
      automaton) | kept-shared: kept, with the scope's shared memory beside it (a
      conversation the drafter holds is neither relearnt nor written there again)
    """

    name = "racer"
    default_capacity = "auto"
    candidates = 64  # proposed with capacity=auto: the paper's fixed capacity

    def __init__(self, n: int = 10, nodes: int = 10_000, k: int = 8, min_border: int = 2, chain: bool = False,
                 sources: str = "both", logits: str = "copy", update: str = "all", memory: str = "kept",
                 shared_nodes: int = 100_000, deep: int = 32) -> None:
        for option, value in (("sources", sources), ("logits", logits), ("update", update), ("memory", memory)):
            if value not in _CHOICES[option]:
                raise ValueError(f"racer: {option}: expected one of {', '.join(_CHOICES[option])}, got {value!r}")
        if min_border < 1:
            raise ValueError(f"racer: min_border: expected at least 1, got {min_border}")
        if isinstance(shared_nodes, bool) or not isinstance(shared_nodes, int) or shared_nodes < n + 1:
            raise ValueError(f"racer: shared_nodes: expected a node capacity of at least n + 1 = {n + 1}, "
                             f"got {shared_nodes!r}")
        if isinstance(deep, bool) or not isinstance(deep, int) or deep < 0:
            raise ValueError(f"racer: deep: expected a chain length of 0 (none) or more, got {deep!r}")
        self.n, self.nodes, self.k, self.min_border, self.chain = n, nodes, k, min_border, bool(chain)
        self.deep = deep
        self.shared_nodes = shared_nodes
        self.sources, self.logits, self.update, self.memory = sources, logits, update, memory
        self.use_retrieval = sources in ("both", "retrieval")
        self.use_logits = sources in ("both", "logits")
        self.use_deep = bool(deep) and self.use_retrieval and not self.chain  # a chain drafts no deep chain
        self.last_logit, self.accepted_only = logits == "last", update == "accepted"
        self.fresh = memory in ("fresh", "shared")
        self.shares = memory in ("shared", "kept-shared")  # reads and writes its scope's memory
        self.keeps_text = self.use_retrieval and not self.fresh  # ``holds`` has text to offer
        # last-logit reads ranks 2..k+1 of the last row (rank 1 is the root itself).
        self.needs = (Needs(topk=k + 1 if self.last_logit else k, prompt=True, prompt_rows="latest")
                      if self.use_logits else Needs())
        self.automaton = NgramAutomaton(n, nodes)
        self.table = CopyLogitTable(k)
        self._last_row: tuple[int, ...] = ()
        self._context: list[int] = []
        # The text of the request it serves, whole (``holds``), where ``keeps_text``.
        self._learnt: list[int] = []
        self.matches = ContextMatch(min_border + 1)
        # This request's accepted draft tokens: by rank (1-based) in the parent's
        # copy-logit row (0: not in the row), and by source.
        self.accepted_ranks: Counter[int] = Counter()
        self.accepted_by_source: Counter[int] = Counter()
        self.accepted_shared = 0  # of which, drafted from the shared memory
        self.accepted_deep = 0  # of which, nodes the deep chain created
        self._shared: SharedMemory | None = None

    def new_shared(self) -> SharedMemory | None:
        return SharedMemory(self.n, self.shared_nodes, self.k) if self.shares else None

    def share(self, shared: SharedMemory | None) -> None:
        self._shared = shared

    # -- request lifecycle -------------------------------------------------------------
    def holds(self, prompt: Sequence[int]) -> int:
        """The automaton holds every window of the last request's text; the copy-logit
        table is refreshed from the prompt's rows whatever this says."""
        if not self._learnt:
            return 0
        return _common_prefix(self._learnt, prompt if isinstance(prompt, list) else [int(t) for t in prompt])

    def begin(self, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.accepted_ranks, self.accepted_by_source, self.accepted_shared = Counter(), Counter(), 0
        self.accepted_deep = 0
        held = self.holds(prompt)
        if self.fresh:
            self.automaton = NgramAutomaton(self.n, self.nodes)
            self.table = CopyLogitTable(self.k)
        self._context = [int(t) for t in prompt]
        if self.use_retrieval:
            # Windows of text it was given already would only count again: a client that
            # resends its conversation has said it once.
            self.automaton.start(self._context, held)
        if self.keeps_text:
            self._learnt = list(self._context)
        if self.use_deep:
            self.matches = ContextMatch(self.min_border + 1)
            self.matches.extend(self._context)
        if prompt_topk is not None:
            self.table.write(self._context[len(self._context) - len(prompt_topk) :], prompt_topk)
            self._last_row = tuple(prompt_topk[-1].tolist())
        if self._shared is not None:
            # What it holds, its earlier request wrote into this same memory already.
            self._shared.begin(self._context, prompt_topk, held)

    def _candidates(self, token: int) -> tuple[int, ...]:
        # last-logit: every node reuses the last step's logits; their rank 1 is the
        # root itself, so ranks 2.. are the guesses for what follows.
        if self.last_logit:
            return self._last_row[1:]
        row = self.table.row(token)
        if not row and self._shared is not None:
            row = self._shared.table.row(token)
        return row

    def _logits_key(self, parent: int, rank: int, depth: int) -> tuple:
        own = self._shared is None or self.last_logit or parent in self.table.rows
        return logits_feature(rank, depth) if own else shared_logits_feature(rank, depth)

    def _agreement(self, parent: int, token: int) -> int:
        """1 if ``token`` is rank 1 of ``parent``'s copy-logit row, 2 if lower in it, else 0."""
        row = self._candidates(parent) if self.use_logits else ()
        if not row or token not in row:
            return 0
        return 1 if row[0] == token else 2

    def draft(self, root: int, budget: int) -> DraftTree:
        builder = TreeBuilder(root, budget)
        if self.use_deep and budget > 1:
            self._add_deep_chain(builder, root, min(self.deep, budget - 1))
        if self.use_retrieval and budget > 1:
            found = self.automaton.retrieve(root, budget - 1, self.min_border)
            if self.chain:  # the deepest of the most frequent continuations
                found = [max(found, key=lambda c: len(c.path))] if found else []
            self._add_retrieved(builder, root, found, retrieval_feature)
            # The shared automaton fills at most half of what the request's own left,
            # so the copy-logit rows keep room; with a chain, only where its own found nothing.
            if self.chain:
                shared_left = 0 if found else budget - 1
            else:
                shared_left = (budget - len(builder)) // 2
            if self._shared is not None and shared_left > 0:
                self._add_shared(builder, root, shared_left)
        left = budget - len(builder)
        if self.use_logits and left > 0:
            if self.chain:
                node = len(builder) - 1 if len(builder) > 1 else 0
                while left > 0:
                    row = self._candidates(builder.tokens[node])
                    if not row:
                        break
                    node = builder.add_child(node, row[0], LOGITS,
                                             logits_feature(0, builder.depths[node] + 1))
                    left -= 1
            else:
                expand_logits_tree(builder, self._candidates, self.k, left,
                                   None if self._shared is None else self._logits_key)
        return builder.build()

    def _add_deep_chain(self, builder: TreeBuilder, root: int, limit: int) -> None:
        match = self.matches.longest(root, limit)
        if match is None:
            return
        parents = [root] + match.continuation[:-1]
        features = [context_feature(match.length + depth, self._agreement(parent, token))
                    for depth, (parent, token) in enumerate(zip(parents, match.continuation))]
        builder.add_path(match.continuation, RETRIEVAL, features=features)

    def _add_shared(self, builder: TreeBuilder, root: int, limit: int) -> None:
        shared = self._shared
        found = shared.automaton.retrieve(root, limit, self.min_border, shared.state(self._context))
        if self.chain:
            found = [max(found, key=lambda c: len(c.path))] if found else []
        self._add_retrieved(builder, root, found, shared_feature)

    def _add_retrieved(self, builder: TreeBuilder, root: int, found: list[Continuation],
                       feature: Callable[[int, int, float], tuple]) -> None:
        for continuation in found:
            parents = [root] + continuation.path[:-1]
            agreements = [self._agreement(parent, token) for parent, token in zip(parents, continuation.path)]
            features = [feature(agreement, continuation.border, ratio)
                        for agreement, ratio in zip(agreements, continuation.ratios)]
            # A retrieved token that its parent's copy-logit row also holds is both sources' draft.
            sources = [RETRIEVAL | (LOGITS if agreement else 0) for agreement in agreements]
            builder.add_path(continuation.path, sources, features=features)

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int]) -> None:
        for node in accepted[1:]:
            if self.use_logits:  # ranks are only reported when the table is in use
                row = self._candidates(tree.tokens[tree.parents[node]])
                token = tree.tokens[node]
                self.accepted_ranks[row.index(token) + 1 if token in row else 0] += 1
            self.accepted_by_source[tree.sources[node] if tree.sources else 0] += 1
            key = tree.features[node] if tree.features else None
            if key and key[0] in _SHARED_KEYS:
                self.accepted_shared += 1
            elif key and key[0] == "context":
                self.accepted_deep += 1
        if tree_topk is not None:
            if self.accepted_only:
                tokens, rows = [tree.tokens[i] for i in accepted], tree_topk[list(accepted)]
            else:
                tokens, rows = tree.tokens, tree_topk
            self.table.write(tokens, rows)
            if self._shared is not None:
                self._shared.write(tokens, rows)
            self._last_row = tuple(tree_topk[accepted[-1]].tolist())
        ctx = self._context
        learnt = self._learnt if self.keeps_text else None
        for i in accepted:
            ctx.append(tree.tokens[i])
            if learnt is not None:
                learnt.append(tree.tokens[i])
            if self.use_deep:
                self.matches.append(tree.tokens[i])
            if self.use_retrieval:
                self.automaton.extend(ctx)
                if self._shared is not None:
                    self._shared.extend(ctx)
        if len(ctx) > 4 * self.n:  # only the last n tokens are ever needed
            del ctx[: len(ctx) - self.n]

    def request_stats(self) -> dict:
        stats = {"accepted_source": {source_name(s): c for s, c in sorted(self.accepted_by_source.items())},
                 "retrieval_nodes": self.automaton.live}
        if self.use_logits:  # ranks in a table that was never filled would read as "not in the row"
            stats["accepted_rank"] = {str(r): c for r, c in sorted(self.accepted_ranks.items())}
        if self._shared is not None:
            stats["accepted_shared"] = self.accepted_shared
        if self.deep:
            stats["accepted_deep"] = self.accepted_deep
        return stats
