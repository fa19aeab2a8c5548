import numpy as np
import pytest

from racer.tree import DraftTree, TreeBuilder, chain


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
