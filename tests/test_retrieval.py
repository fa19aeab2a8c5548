"""The LRU Aho–Corasick Retrieval Tree against a brute-force oracle."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from racer.drafting.automaton import ROOT, NgramAutomaton


class Recording(NgramAutomaton):
    """Records every eviction with whether the victim was a leaf and the LRU tail."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evicted = []

    def _evict_lru(self):
        victim = self._prev[ROOT]
        self.evicted.append((victim, not self.children[victim], victim == self.lru_order()[0]))
        super()._evict_lru()


def feed(tree: NgramAutomaton, stream: list[int], prompt_len: int, checks=None) -> list[int]:
    """Drive the tree as the drafter does: all full windows of the prompt, then one
    token at a time (insert the window ending there, then advance)."""
    ctx = stream[:prompt_len]
    tree.start(ctx)
    if checks:
        checks(tree, ctx)
    for token in stream[prompt_len:]:
        ctx.append(token)
        tree.extend(ctx)
        if checks:
            checks(tree, ctx)
    return ctx


def contents(tree: NgramAutomaton) -> dict[tuple[int, ...], int]:
    return {tree.string(node): tree.freq[node] for node in tree.live_nodes()}


def oracle_borders(trie: dict, ctx: list[int], root: int, min_depth: int = 2) -> set:
    seq = ctx + [root]
    return {tuple(seq[-L:]) for L in range(min_depth, len(seq) + 1) if tuple(seq[-L:]) in trie}


def oracle_state(trie: dict, ctx: list[int]) -> tuple:
    for L in range(min(len(ctx), max((len(s) for s in trie), default=0)), 0, -1):
        if tuple(ctx[-L:]) in trie:
            return tuple(ctx[-L:])
    return ()


def oracle_retrieve(trie: dict, borders: set, limit: int) -> list[tuple[int, int]]:
    """(freq, relative depth) of the top ``limit`` candidates, best first."""
    cands = [(-f, len(s) - len(b)) for b in borders for s, f in trie.items() if len(s) > len(b) and s[: len(b)] == b]
    return sorted(cands)[:limit]


def check_links(tree: NgramAutomaton, trie: dict) -> None:
    live = set(tree.live_nodes())
    for node in live:
        s = tree.string(node)
        want = next((s[i:] for i in range(1, len(s)) if s[i:] in trie), ())
        assert tree.fail[node] in live | {ROOT}, "failure link to a recycled node"
        assert tree.string(tree.fail[node]) == want
    # The reverse links are exactly the links: a stale entry would misdirect a later
    # insertion's or eviction's updates.
    reverse = {(link, node) for link in live | {ROOT} for node in tree.fail_in[link]}
    assert reverse == {(tree.fail[node], node) for node in live}
    assert tree.state in live | {ROOT}, "matching state on a recycled node"


streams = st.lists(st.integers(0, 4), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(streams, st.integers(2, 5), st.data())
def test_without_eviction_matches_the_oracle(stream, n, data):
    prompt_len = data.draw(st.integers(0, len(stream)))
    tree = NgramAutomaton(n=n, capacity=100_000)
    windows = []

    def checks(t, ctx):
        trie = contents(t)
        # Frequencies are the number of inserted windows through each prefix.
        assert trie == dict(Counter(w[:i] for w in windows for i in range(1, len(w) + 1)))
        assert t.string(t.state) == oracle_state(trie, ctx)
        for root in range(5):
            borders = [t.string(b) for b in t.borders(root)]
            assert set(borders) == oracle_borders(trie, ctx, root)
            assert borders == sorted(borders, key=len, reverse=True)
            got = t.retrieve(root, 6)
            assert [(-c.freq, len(c.path)) for c in got] == oracle_retrieve(trie, set(borders), 6)
            for path, f, _, _ in got:  # each path ends at a node with that freq under a border
                assert any(trie.get(b + tuple(path)) == f for b in borders)

    ctx_windows = [tuple(stream[e - n : e]) for e in range(n, len(stream) + 1)]
    # Windows are inserted in stream order; track them alongside the tree.
    orig_insert = tree.insert

    def insert(window):
        windows.append(tuple(window))
        return orig_insert(window)

    tree.insert = insert
    feed(tree, stream, prompt_len, checks)
    assert windows == ctx_windows
    check_links(tree, contents(tree))


@settings(max_examples=150, deadline=None)
@given(streams, st.integers(2, 4), st.integers(0, 12), st.data())
def test_under_eviction_invariants_hold(stream, n, extra, data):
    capacity = n + 1 + extra
    prompt_len = data.draw(st.integers(0, len(stream)))
    tree = Recording(n=n, capacity=capacity)

    def checks(t, ctx):
        assert t.live <= capacity and len(t.live_nodes()) + 1 == t.live
        trie = contents(t)
        check_links(t, trie)
        assert t.string(t.state) == oracle_state(trie, ctx)
        # LRU: every node is used no more recently than its parent.
        rank = {node: i for i, node in enumerate(t.lru_order())}
        for node in t.live_nodes():
            if t.parent[node] != ROOT:
                assert rank[node] < rank[t.parent[node]]
        for root in range(5):
            borders = {t.string(b) for b in t.borders(root)}
            assert borders == oracle_borders(trie, ctx, root)
            got = t.retrieve(root, 5)
            assert [(-c.freq, len(c.path)) for c in got] == oracle_retrieve(trie, borders, 5)

    feed(tree, stream, prompt_len, checks)
    assert all(leaf and tail for _, leaf, tail in tree.evicted)
    if len(set(stream)) > 1 and len(stream) > 3 * capacity:
        assert tree.evictions > 0


@settings(max_examples=150, deadline=None)
@given(streams, streams, st.integers(2, 5), st.data())
def test_a_prompt_that_resends_learnt_text_counts_each_window_once(history, new, n, data):
    """A kept drafter's next prompt often resends the last request's text (a client's
    conversation): ``start(prompt, held)`` inserts only the windows that end past the
    ``held`` tokens, so each window of the text is counted once."""
    prompt_len = data.draw(st.integers(0, len(history)))
    held = data.draw(st.integers(0, len(history)))
    prompt = history[:held] + new
    tree = NgramAutomaton(n=n, capacity=100_000)
    feed(tree, list(history), prompt_len)
    tree.start(prompt, held)
    windows = [tuple(history[e - n : e]) for e in range(n, len(history) + 1)]
    ends = range(max(n, min(held, len(prompt) - 1) + 1), len(prompt) + 1)
    windows += [tuple(prompt[e - n : e]) for e in ends]
    trie = contents(tree)
    assert trie == dict(Counter(w[:i] for w in windows for i in range(1, len(w) + 1)))
    check_links(tree, trie)
    assert tree.string(tree.state) == oracle_state(trie, prompt)
    if held == len(history) and len(prompt) > held:  # the prompt extends the text: as if learnt once
        once = NgramAutomaton(n=n, capacity=100_000)
        once.start(list(prompt))
        assert trie == contents(once) and tree.lru_order() == once.lru_order()


def test_recycled_slots_are_reused_and_memory_is_bounded():
    tree = NgramAutomaton(n=4, capacity=50)
    stream = [(i * 7919) % 31 for i in range(2000)]
    feed(tree, stream, 100)
    assert tree.live <= 50 and len(tree.token) <= 50 and tree.evictions > 1000
    check_links(tree, contents(tree))


def test_failure_chain_keeps_retrieval_alive_after_a_mismatch():
    """The reference drops to depth 1 after a mismatch (its links are erased); here a
    shorter suffix still finds its continuation."""
    tree = NgramAutomaton(n=4, capacity=1000)
    ctx = feed(tree, [1, 2, 3, 4, 9, 9, 9, 7, 2, 3], 10)
    assert ctx[-2:] == [2, 3]
    # Context ends "... 7 2 3"; "7 2 3" never occurred, but "2 3" -> root 4 did.
    assert [tree.string(b) for b in tree.borders(4)] == [(2, 3, 4), (3, 4)]
    assert tree.retrieve(4, 10)[0].path == [9]


def test_bad_options():
    import pytest

    with pytest.raises(ValueError, match="n"):
        NgramAutomaton(n=1)
    with pytest.raises(ValueError, match="capacity"):
        NgramAutomaton(n=10, capacity=5)
