import numpy as np
import pytest

from racer.drafting.tree import DraftTree, TreeBuilder, chain


def test_builder_merges_shared_prefixes_and_flattens_breadth_first():
    b = TreeBuilder(root=7, capacity=10)
    assert b.add_path([1, 2, 3]) == 3
    assert b.add_path([1, 2, 4]) == 1  # shares 1, 2
    assert b.add_path([5]) == 1
    t = b.build()
    assert t.tokens == (7, 1, 5, 2, 3, 4)
    assert t.parents == (-1, 0, 0, 1, 3, 3)
    assert t.depths == (0, 1, 1, 2, 3, 3)
    assert t.child(3, 4) == 5 and t.child(0, 9) is None
    assert t.leaf_paths() == [[0, 2], [0, 1, 3, 4], [0, 1, 3, 5]]
    assert not t.is_chain


def test_capacity_counts_the_root_and_stops_quietly():
    b = TreeBuilder(root=0, capacity=3)
    assert b.add_path([1, 2, 3, 4]) == 2
    assert len(b.build()) == 3
    with pytest.raises(ValueError, match="capacity"):
        TreeBuilder(root=0, capacity=0)


def test_ancestor_mask_is_ancestors_and_self():
    t = TreeBuilder(0, 8)
    t.add_path([1, 2])
    t.add_path([3])
    tree = t.build()  # 0; 1, 3; 2 under 1
    m = tree.ancestor_mask()
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert (m == expected).all()


def test_chain_and_single():
    assert chain(4, [5, 6]).is_chain and chain(4, [5, 6]).tokens == (4, 5, 6)
    assert DraftTree.single(9).tokens == (9,) and DraftTree.single(9).is_chain


def test_subtree_reindexes_and_keeps_sources_and_features():
    b = TreeBuilder(0, 10)
    a = b.add_child(0, 1, 1, ("a",))
    b.add_child(0, 2, 2, ("b",))
    c = b.add_child(a, 3, 1, ("c",))
    b.add_child(c, 4, 2, ("d",))
    tree = b.build()
    keep = [0, tree.child(0, 1), tree.child(tree.child(0, 1), 3)]
    sub = tree.subtree(sorted(keep))
    assert sub.tokens == (0, 1, 3) and sub.parents == (-1, 0, 1) and sub.depths == (0, 1, 2)
    assert sub.child(1, 3) == 2 and sub.child(0, 2) is None
    assert sub.sources == (0, 1, 1) and sub.features == (None, ("a",), ("c",))
    assert tree.subtree(list(range(len(tree)))) is tree
    with pytest.raises(ValueError, match="without its parent"):
        tree.subtree([0, tree.child(tree.child(0, 1), 3)])
    with pytest.raises(ValueError, match="root"):
        tree.subtree([1, 2])
