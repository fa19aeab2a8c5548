"""Token Recycling: the adjacency table and the static template, on hand-built tables."""

from collections import Counter

import numpy as np
import pytest

from racer.drafting import make_drafter, parse_method
from racer.drafting.token_recycling import TEMPLATE, TokenRecyclingDrafter
from racer.drafting.tree import DraftTree, TreeBuilder


def rows(table: dict[int, list[int]]) -> tuple[list[int], np.ndarray]:
    tokens = list(table)
    return tokens, np.array([table[t] for t in tokens])


def test_template_is_the_published_81_node_tree():
    assert len(TEMPLATE) == 80
    assert Counter(len(path) for path in TEMPLATE) == {1: 8, 2: 21, 3: 25, 4: 15, 5: 8, 6: 3}
    assert len(set(TEMPLATE)) == 80
    seen = {()}
    for path in TEMPLATE:  # breadth-first: every parent comes first
        assert path[:-1] in seen
        seen.add(path)


def test_template_filled_from_the_table_by_candidate_rank():
    d = TokenRecyclingDrafter()
    # Only tokens 1 and 2 have rows; 2 is the root's first candidate.
    d.begin([1], None)
    d.observe(DraftTree.single(1), np.array([[2, 3, 4, 5, 6, 7, 8, 9]]), [0])
    d.observe(DraftTree.single(2), np.array([[20, 21, 22, 23, 24, 25, 26, 27]]), [0])
    tree = d.draft(1, 1000)
    # Level 1: all 8 candidates of the root. Level 2: the template's "0x" nodes are the
    # candidates of token 2; "10", "20", ... need rows of 3..9, which are unknown.
    # Level 3: "000" needs the row of 20: unknown. So 1 + 8 + 8 nodes.
    assert tree.tokens == (1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23, 24, 25, 26, 27)
    assert tree.parents == (-1,) + (0,) * 8 + (1,) * 8


def test_deep_template_positions():
    # Row of v: v*10 + 0..7, so a node's token spells its template path.
    table = {}
    for path in [()] + list(TEMPLATE):
        token = int("9" + "".join(str(r + 1) for r in path))  # root 9; child r of v -> v*10 + r + 1
        table[token] = [token * 10 + r + 1 for r in range(8)]
    d = TokenRecyclingDrafter()
    d.begin([9], None)
    tokens, topk = rows(table)
    d.table.write(tokens, topk)
    tree = d.draft(9, 1000)
    assert len(tree) == 81
    expected = {int("9" + "".join(str(r + 1) for r in path)) for path in TEMPLATE}
    assert set(tree.tokens[1:]) == expected
    # e.g. template node "0001" = 2nd candidate of (1st of 1st of 1st): 9 -> 91 -> 911 -> 9111 -> 91112
    node = tree.tokens.index(91112)
    assert [tree.tokens[i] for i in tree.path_to(node)] == [9, 91, 911, 9111, 91112]


def test_capacity_keeps_the_first_template_nodes():
    method = parse_method("token-recycling:capacity=5")
    d = method.drafter
    d.begin([1], None)
    d.table.write([1, 2], np.array([[2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27]]))
    assert d.draft(1, method.draft_size).tokens == (1, 2, 3, 4, 5)
    assert d.draft(1, 3).tokens == (1, 2, 3)  # the room left in the context also caps it


def test_every_verified_node_rewrites_its_row_last_write_wins():
    d = TokenRecyclingDrafter()
    d.begin([1], None)
    builder = TreeBuilder(1, 10)
    builder.add_path([2, 1])   # nodes: 0:1, 1:2, 2:1 (token 1 again, deeper)
    builder.add_path([3])      # node 3:3, rejected below
    tree = builder.build()
    topk = np.arange(tree.__len__() * 8).reshape(-1, 8) + 100
    d.observe(tree, topk, [0])  # only the root accepted; every node still writes
    by_token = {tree.tokens[i]: tuple(topk[i]) for i in range(len(tree))}  # later nodes overwrite
    for token, row in by_token.items():
        assert d.table.row(token) == row
    assert d.table.row(1) == tuple(topk[tree.tokens.index(1, 1)])  # the deeper 1 wins


def test_nothing_is_drafted_for_an_unknown_root():
    d = TokenRecyclingDrafter()
    d.begin([5, 6], None)
    assert d.draft(6, 100).tokens == (6,)


def test_prefill_option_fills_the_table_from_the_prompt():
    prompt, topk = [4, 5], np.array([[50, 51, 52, 53, 54, 55, 56, 57], [60, 61, 62, 63, 64, 65, 66, 67]])
    plain, prefilled = TokenRecyclingDrafter(), make_drafter("token-recycling:prefill=true")
    assert prefilled.needs.prompt and not plain.needs.prompt
    for d in (plain, prefilled):
        d.begin(prompt, topk)
    assert plain.draft(5, 100).tokens == (5,)
    assert prefilled.draft(5, 100).tokens[:3] == (5, 60, 61)


@pytest.mark.parametrize("memory, kept", [("kept", True), ("fresh", False)])
def test_table_memory_across_requests(memory, kept):
    d = TokenRecyclingDrafter(memory=memory)
    d.begin([1], None)
    d.observe(DraftTree.single(1), np.array([[2, 3, 4, 5, 6, 7, 8, 9]]), [0])
    d.begin([7], None)
    assert (len(d.draft(1, 100)) > 1) == kept


def test_bad_options():
    with pytest.raises(ValueError, match="capacity"):
        make_drafter("token-recycling:capacity=0")
    with pytest.raises(ValueError, match="memory"):
        make_drafter("token-recycling:memory=forever")
