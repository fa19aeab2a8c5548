"""RACER's retrieval source (the paper's "Retrieval Tree"): an Aho–Corasick automaton
over the context's n-grams with a fixed node capacity and LRU eviction of leaves.

Invariants kept at every moment (the property tests check them against brute force):
- every node's failure link is the node of the longest proper suffix of its string
  that is in the trie (links are updated as nodes are added and recycled);
- the matching state is the node of the longest suffix of the context in the trie;
- a node is never less recently used than any of its descendants, so the LRU tail is
  always a leaf, and only leaves are evicted.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

ROOT = 0
_FREE = -2  # parent value of a recycled slot


class Continuation(NamedTuple):
    """A retrieved continuation: the tokens after the root, its end node's ``freq``, the
    depth of the border it hangs from (how many context tokens matched) and, per token,
    its node's freq over its trie parent's."""

    path: list[int]
    freq: int
    border: int
    ratios: list[float]


class NgramAutomaton:
    def __init__(self, n: int = 10, capacity: int = 10_000) -> None:
        if n < 2:
            raise ValueError(f"n: expected an n-gram length of at least 2, got {n}")
        if capacity < n + 1:
            raise ValueError(f"nodes: expected a node capacity of at least n + 1 = {n + 1}, got {capacity}")
        self.n = n
        self.capacity = capacity
        self.token = [-1]
        self.parent = [-1]
        self.depth = [0]
        self.freq = [0]
        self.children: list[dict[int, int]] = [{}]
        self.fail = [ROOT]
        self.fail_in: list[set[int]] = [set()]  # reverse failure links
        # LRU as a doubly linked list over slots; slot 0 (root) doubles as sentinel.
        # _next[ROOT] is the most recent node, _prev[ROOT] the least recent.
        self._prev = [ROOT]
        self._next = [ROOT]
        self._free: list[int] = []
        self.by_token: dict[int, set[int]] = {}  # live nodes carrying each token
        self.live = 1
        self.state = ROOT
        self.evictions = 0

    # -- LRU --------------------------------------------------------------------------
    def _unlink(self, node: int) -> None:
        p, q = self._prev[node], self._next[node]
        self._next[p] = q
        self._prev[q] = p

    def _push_front(self, node: int) -> None:
        head = self._next[ROOT]
        self._prev[node], self._next[node] = ROOT, head
        self._prev[head] = node
        self._next[ROOT] = node

    def _touch_one(self, node: int) -> None:
        if node != ROOT:
            self._unlink(node)
            self._push_front(node)

    def touch(self, node: int) -> None:
        """Mark ``node`` used; its ancestors become at least as recent as it."""
        while node != ROOT:
            self._touch_one(node)
            node = self.parent[node]

    def lru_order(self) -> list[int]:
        """Live non-root nodes, least recently used first."""
        order, node = [], self._prev[ROOT]
        while node != ROOT:
            order.append(node)
            node = self._prev[node]
        return order

    # -- nodes ------------------------------------------------------------------------
    def _evict_lru(self) -> None:
        victim = self._prev[ROOT]
        assert victim != ROOT and not self.children[victim], "LRU tail must be a leaf"
        self._unlink(victim)
        del self.children[self.parent[victim]][self.token[victim]]
        self.by_token[self.token[victim]].discard(victim)
        target = self.fail[victim]
        self.fail_in[target].discard(victim)
        # Nodes whose longest suffix was the victim fall back to the victim's own.
        for node in self.fail_in[victim]:
            self.fail[node] = target
            self.fail_in[target].add(node)
        self.fail_in[victim] = set()
        if self.state == victim:
            self.state = target
        self.parent[victim] = _FREE
        self.children[victim] = {}
        self._free.append(victim)
        self.live -= 1
        self.evictions += 1

    def _suffix_of(self, longer: int, shorter: int) -> bool:
        """Whether the string of ``shorter`` is a suffix of the string of ``longer``."""
        while shorter != ROOT:
            if self.token[longer] != self.token[shorter]:
                return False
            longer, shorter = self.parent[longer], self.parent[shorter]
        return True

    def _new_node(self, parent: int, token: int) -> int:
        if self.live >= self.capacity:
            self._evict_lru()
        if self._free:
            node = self._free.pop()
            self.token[node], self.parent[node] = token, parent
            self.depth[node], self.freq[node] = self.depth[parent] + 1, 0
            self._prev[node] = self._next[node] = ROOT
        else:
            node = len(self.token)
            self.token.append(token)
            self.parent.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.freq.append(0)
            self.children.append({})
            self.fail.append(ROOT)
            self.fail_in.append(set())
            self._prev.append(ROOT)
            self._next.append(ROOT)
        self.children[parent][token] = node
        self.live += 1
        self._push_front(node)
        # Its own failure link: the first node down the parent's failure chain that
        # has a child for this token.
        link = ROOT
        if parent != ROOT:
            f = self.fail[parent]
            while True:
                child = self.children[f].get(token)
                if child is not None:
                    link = child
                    break
                if f == ROOT:
                    break
                f = self.fail[f]
        self.fail[node] = link
        self.fail_in[link].add(node)
        # Existing nodes whose string ends with this one's, and whose link was shorter,
        # now link here. Such a node's old link was a suffix of this string in the trie,
        # and the longest such (this node's own link), so they are among the nodes
        # linked to ``link``; they also carry the same token: the smaller set is examined.
        same = self.by_token.setdefault(token, set())
        d = self.depth[node]
        pool = self.fail_in[link] if len(self.fail_in[link]) < len(same) else same
        moved = [other for other in pool
                 if self.token[other] == token and self.depth[other] > d
                 and self.depth[self.fail[other]] < d and self._suffix_of(other, node)]
        for other in moved:
            self.fail_in[self.fail[other]].discard(other)
            self.fail[other] = node
            self.fail_in[node].add(other)
        same.add(node)
        return node

    def insert(self, window: Sequence[int]) -> int:
        """Insert one n-gram (or shorter) window, counting ``freq`` along its path;
        returns the window's node."""
        node = ROOT
        for token in window:
            child = self.children[node].get(token)
            if child is None:
                child = self._new_node(node, token)
            else:
                self._touch_one(child)  # keep the path safe from eviction while descending
            self.freq[child] += 1
            node = child
        self.touch(node)  # deepest first, then ancestors: ancestors end most recent
        return node

    def extend(self, context: Sequence[int]) -> None:
        """The context grew by its last token: insert the n-gram ending there and move
        the matching state. Once that window is in the trie it is the longest suffix
        of the context there (nothing is deeper than n), so the state is its node;
        a context shorter than n moves by goto/failure transitions."""
        if len(context) >= self.n:
            self.state = self.insert(context[-self.n :])
        else:
            self.advance(context[-1])

    def insert_windows(self, context: Sequence[int], held: int = 0) -> int:
        """Insert every full n-gram window of ``context`` but those that lie within its
        first ``held`` tokens, leaving the matching state alone; returns the last
        window's node (ROOT: none, the context is shorter)."""
        n, node = self.n, ROOT
        for end in range(max(n, held + 1), len(context) + 1):
            node = self.insert(context[end - n : end])
        return node

    def start(self, context: Sequence[int], held: int = 0) -> None:
        """A new context (a prompt): insert its full windows, set the state. ``held``:
        its first tokens are text whose windows this automaton was given already (the
        last context it learnt), so only the windows that end past them are inserted,
        and the last window in any case, which the state stands on."""
        if len(context) >= self.n:
            self.state = self.insert_windows(context, min(held, len(context) - 1))
        else:
            self.reset_state(context)

    # -- matching -----------------------------------------------------------------------
    def goto(self, state: int, token: int) -> int:
        while True:
            child = self.children[state].get(token)
            if child is not None:
                return child
            if state == ROOT:
                return ROOT
            state = self.fail[state]

    def advance(self, token: int) -> None:
        self.state = self.goto(self.state, token)
        self.touch(self.state)

    def reset_state(self, context_tail: Iterable[int]) -> None:
        """Match from scratch over the last tokens of a context."""
        self.state = ROOT
        for token in context_tail:
            self.advance(token)

    def match(self, tail: Iterable[int]) -> int:
        """The node of the longest suffix of ``tail`` in the trie, touching nothing: the
        matching state of a context that ends with ``tail`` (its last n - 1 tokens
        suffice) in an automaton other contexts write into too."""
        state = ROOT
        for token in tail:
            state = self.goto(state, token)
        return state

    def borders(self, root: int, min_depth: int = 2, state: int | None = None) -> list[int]:
        """Nodes for every suffix of context + ``root`` in the trie with at least
        ``min_depth`` tokens, longest first; the context's matching state is
        ``state`` (default: this automaton's own)."""
        found = []
        state = self.state if state is None else state
        while True:
            child = self.children[state].get(root)
            if child is not None and self.depth[child] >= min_depth:
                found.append(child)
            if state == ROOT:
                return found
            state = self.fail[state]

    def retrieve(self, root: int, limit: int, min_depth: int = 2, state: int | None = None) -> list[Continuation]:
        """Up to ``limit`` continuations (token paths after ``root``) from all border
        subtrees, the most frequent nodes first; ties go to the shallower. ``state``:
        as in ``borders``."""
        out = []
        for end, path in self._retrieve(root, limit, min_depth, state):
            ratios = []
            node = end
            for _ in path:
                parent = self.parent[node]
                ratios.append(self.freq[node] / max(self.freq[parent], 1))
                node = parent
            out.append(Continuation(path, self.freq[end], self.depth[node], ratios[::-1]))
        return out

    def _retrieve(self, root: int, limit: int, min_depth: int, state: int | None) -> list[tuple[int, list[int]]]:
        if limit <= 0:
            return []
        frontier = [(b, ()) for b in self.borders(root, min_depth, state)]
        chosen: list[tuple[int, int, int, tuple[int, ...], int]] = []  # (-freq, depth, order, path, node)
        order = 0
        while frontier:
            level = []
            for node, path in frontier:
                for token, child in self.children[node].items():
                    level.append((-self.freq[child], len(path) + 1, order, path + (token,), child))
                    order += 1
            if not level:
                break
            level.sort()
            merged = sorted(chosen + level)[:limit]
            kept = {entry[2] for entry in merged}
            added = [(child, path) for (_, _, o, path, child) in level if o in kept]
            chosen = merged
            if not added:  # freq never grows down a path: nothing deeper can enter
                break
            frontier = added
        return [(end, list(path)) for (_, _, _, path, end) in sorted(chosen)]

    # -- introspection for tests ----------------------------------------------------------
    def string(self, node: int) -> tuple[int, ...]:
        out = []
        while node != ROOT:
            out.append(self.token[node])
            node = self.parent[node]
        return tuple(reversed(out))

    def live_nodes(self) -> list[int]:
        return [i for i in range(1, len(self.token)) if self.parent[i] != _FREE]
