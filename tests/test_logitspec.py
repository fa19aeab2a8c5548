"""LogitSpec: the context n-gram index, the rank-based pruning and the tree it drafts."""

import numpy as np
import pytest

from racer.drafting import Needs, make_drafter
from racer.drafting.logitspec import LogitSpecDrafter, NgramIndex, tokens_kept
from racer.drafting.tree import DraftTree


def test_pruning_by_guess_rank():
    assert [tokens_kept(r) for r in (1, 8, 9, 32, 33, 63)] == [4, 4, 3, 3, 1, 1]


def test_index_keeps_the_most_recent_occurrence_unless_its_continuation_is_shorter():
    index = NgramIndex(max_n=3, length=4)
    index.reset([1, 2, 3, 4, 5, 6, 1, 2, 7, 8, 9, 9, 1, 2])
    # (1, 2) at 6 has 4 tokens after it (as many as at 0): the more recent one wins;
    # at 12 it has none, so it is not indexed there.
    assert index.maps[1][(1, 2)] == [7, 8, 9, 9]
    # (9,) at 11 has 2 tokens after it, fewer than at 10 (3): the entry stays.
    assert index.maps[0][(9,)] == [9, 1, 2]
    index.extend([5, 5])  # now (9,) at 11 is followed by 1, 2, 5, 5: as long, so it wins
    assert index.maps[0][(9,)] == [1, 2, 5, 5]
    assert index.lookup([0, 1, 2]) == [7, 8, 9, 9]  # 3-gram (0, 1, 2) unknown -> 2-gram
    assert index.lookup([0, 0, 0]) == []


def test_drafted_tree_follows_the_guess_ranks():
    # Context: for each guess g = 101..140, "g, g+1000, g+2000, g+3000, g+4000" once.
    guesses = list(range(101, 141))
    context = [t for g in guesses for t in (g, g + 1000, g + 2000, g + 3000, g + 4000)]
    root = 7  # never seen: no root chain
    d = LogitSpecDrafter(guesses=41)
    d.begin(context, np.array([[root] + guesses]))
    tree = d.draft(root, 1000)
    chains = [[tree.tokens[i] for i in path[1:]] for path in tree.leaf_paths()]
    expected = [[g, g + 1000, g + 2000, g + 3000][: tokens_kept(rank)] for rank, g in enumerate(guesses, 1)]
    assert sorted(chains) == sorted(expected)
    assert len(tree) == 1 + 8 * 4 + 24 * 3 + 8 * 1

    d64 = LogitSpecDrafter()  # 64 candidates: 8 x 4 + 10 x 3 + 1 (cut) = 63 draft tokens
    d64.begin(context, np.array([[root] + guesses]))
    tree = d64.draft(root, d64.candidates)
    assert len(tree) == 64
    assert {tree.tokens[i] for i in range(1, 64) if tree.depths[i] == 1} == set(guesses[:19])


def test_root_chain_comes_first_and_uses_the_longest_suffix():
    context = [1, 2, 3, 4, 5, 6, 9, 3, 8, 8, 2]
    d = LogitSpecDrafter(guesses=1)
    d.begin(context, np.array([[3]]))  # no guesses besides the root
    # context + root = ..., 8, 2, 3: (8, 2, 3) unknown; (2, 3) at 1 -> 4, 5, 6, 9, 3, 8, 8, 2
    assert d.draft(3, 100).tokens == (3, 4, 5, 6, 9, 3, 8, 8, 2)


def test_merge_saves_capacity_the_original_layout_spends():
    # Root 3's chain is (4, 5); the best guess, 4, retrieves (5) after (3, 4): the same
    # path. The original spends capacity on that duplicate chain; the merged trie does not.
    context, row = [3, 4, 5], np.array([[3, 4, 50, 51, 52, 53]])
    merged = LogitSpecDrafter(guesses=6)
    original = LogitSpecDrafter(guesses=6, merge=False)
    for d in (merged, original):
        d.begin(context, row)
    assert merged.draft(3, 6).tokens == (3, 4, 50, 51, 52, 5)
    assert original.draft(3, 6).tokens == (3, 4, 50, 5)  # 2 + 2 + 1 = 5 proposed tokens


def test_observe_extends_the_index_and_takes_the_last_row():
    d = LogitSpecDrafter(guesses=3)
    assert d.needs == Needs(topk=3, at="last")
    d.begin([1, 2], np.array([[9, 9, 9]]))
    tree = DraftTree.single(3)
    d.observe(tree, np.array([[4, 5, 6]]), [0])
    assert d.index.context == [1, 2, 3]
    # next root 4: guesses 5, 6; (3, 4) unknown... the context gives nothing after 5 or 6
    assert set(d.draft(4, 100).tokens) == {4, 5, 6}


def test_bad_options():
    with pytest.raises(ValueError, match="capacity"):
        make_drafter("logitspec:capacity=0")
    with pytest.raises(ValueError, match="guesses"):
        make_drafter("logitspec:guesses=-3")
