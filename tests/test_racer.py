"""RACER drafting: breadth allocation, integration of both sources, options."""

import numpy as np
import pytest

from racer.drafting import make_drafter, method_options, parse_method
from racer.drafting.copy_logit import CopyLogitTable, child_breadth, expand_logits_tree
from racer.drafting.racer import RacerDrafter
from racer.drafting.tree import RETRIEVAL
from racer.drafting.tree import TreeBuilder


def full_table(vocab=1000, k=8):
    """Every token has a row of k distinct ids (no merges inside a row)."""
    table = CopyLogitTable(k)
    tokens = np.arange(vocab)
    table.write(tokens, (tokens[:, None] * 7 + np.arange(1, k + 1)[None, :]) % vocab)
    return table


def level_sizes(tree):
    return np.bincount(np.array(tree.depths)).tolist()


def test_breadth_allocation_gives_the_documented_shape():
    table = full_table()
    builder = TreeBuilder(root=3, capacity=1 + 8 + 12 + 17)
    expand_logits_tree(builder, table.row, 8, 10_000)
    tree = builder.build()
    # A node's child count is its breadth. Root: 8 children with breadths
    # 4, 2, 1, 1, 1, 1, 1, 1 -> 12 grandchildren. Depth-1 nodes keep their breadth
    # for their first child (4 -> 4, 2, 1, 1; 2 -> 2, 1; 1 -> 1), so level 3 has
    # 4+2+1+1 + 2+1 + 6*1 = 17 nodes.
    assert level_sizes(tree) == [1, 8, 12, 17]
    root_children = [tree.children[0][t] for t in table.row(3)]
    assert [len(tree.children[c]) for c in root_children] == [4, 2, 1, 1, 1, 1, 1, 1]
    first = root_children[0]
    grandchildren = [tree.children[first][t] for t in table.row(tree.tokens[first])[:4]]
    assert [len(tree.children[g]) for g in grandchildren] == [4, 2, 1, 1]
    assert [child_breadth(4, j, 2) for j in range(4)] == [2, 1, 1, 1]  # deeper nodes halve


def test_rank_one_chains_continue_until_capacity():
    table = full_table()
    builder = TreeBuilder(root=3, capacity=200)
    expand_logits_tree(builder, table.row, 8, 10_000)
    tree = builder.build()
    assert len(tree) == 200 and max(tree.depths) > 4


def test_unseen_tokens_propose_nothing():
    """The reference drafts token 0 for rows never written."""
    d = RacerDrafter(sources="logits")
    d.begin([5, 6, 7], np.array([[1, 2, 3, 4, 5, 6, 7, 8]] * 3))
    assert d.draft(99, 64).tokens == (99,)
    assert d.draft(6, 64).tokens[:2] == (6, 1)


def test_retrieval_first_then_logits_fill_the_rest_and_merge():
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2]
    topk = np.tile(np.arange(10, 18), (len(prompt), 1))
    topk[prompt.index(4)] = [5, 6, 30, 31, 32, 33, 34, 35]  # row of token 4
    d = RacerDrafter(n=4, k=8)
    d.begin(prompt, topk)
    tree = d.draft(3, 10)
    assert len(tree) == 10
    retrieved = [i for i, s in enumerate(tree.sources) if s == RETRIEVAL]
    # "1 2 3" and "2 3" occurred: continuations 4 -> 5 / 6.
    assert {tree.tokens[i] for i in retrieved} >= {4, 5, 6}
    node4 = tree.children[0][4]
    # The logits tree proposes 5 and 6 under 4 too; they merged with retrieval's.
    assert set(tree.children[node4]) == {5, 6}


def test_the_budget_bounds_the_tree_and_capacity_auto_proposes_64_candidates():
    d = RacerDrafter()
    prompt = list(range(50)) * 3
    d.begin(prompt, np.tile(np.arange(8), (len(prompt), 1)))
    assert len(d.draft(10, 1000)) > 64  # the drafter itself has no capacity
    assert len(d.draft(10, 16)) == 16 and len(d.draft(10, 5)) == 5
    method = parse_method("racer:capacity=16")
    assert (method.capacity, method.draft_size, method.auto) == (16, 16, False)
    assert parse_method("racer").draft_size == d.candidates == 64


def test_chain_mode_drafts_one_path():
    d = RacerDrafter(chain=True, n=4)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2]
    d.begin(prompt, np.tile(np.arange(10, 18), (len(prompt), 1)))
    assert d.draft(3, 64).is_chain


def test_fresh_memory_forgets_and_kept_memory_remembers():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    topk = np.tile(np.arange(20, 28), (len(prompt), 1))
    for memory, remembers in (("kept", True), ("fresh", False)):
        d = RacerDrafter(n=4, memory=memory, sources="retrieval")
        d.begin(prompt, topk)
        d.begin([40, 41, 2, 3], topk[:4])  # second request ends in "2 3"
        assert (len(d.draft(4, 64)) > 1) == remembers


def test_accepted_rank_statistics():
    d = RacerDrafter(sources="logits")
    d.begin([5, 6], np.array([[9, 8, 7, 6, 5, 4, 3, 2], [9, 8, 7, 6, 5, 4, 3, 2]]))
    tree = d.draft(6, 64)
    path = [0, tree.children[0][9]]
    d.observe(tree, np.tile(np.arange(8), (len(tree), 1)), path)
    assert d.accepted_ranks == {1: 1}


@pytest.mark.parametrize("spec, pattern", [
    ("racer:sources=both2", "sources"), ("racer:memory=forever", "memory"), ("racer:capacity=0", "capacity"),
    ("racer:update=some", "update"), ("racer:logits=first", "logits"), ("racer:n=1", "n"), ("racer:k=0", "k"),
])
def test_bad_options_are_named(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_drafter(spec)


def test_options_reach_the_drafter():
    method = parse_method("racer:capacity=16:memory=fresh:sources=logits:logits=last")
    d = method.drafter
    assert (method.capacity, d.fresh, d.use_retrieval, d.last_logit) == (16, True, False, True)
    described = method.describe()
    assert described["capacity"] == 16 and described["memory"] == "fresh" and described["logits"] == "last"
    assert set(described) == {"method", "capacity", *method_options("racer")}


def test_nodes_carry_the_evidence_the_draft_budget_learns_from():
    # "1 2 3" is followed by 4 three times and by 9 once: after root 3 (context "1 2"),
    # the border is "1 2 3" (depth 3); 4 continues it 3 times in 4, 9 once in 4.
    prompt = [1, 2, 3, 4, 7, 1, 2, 3, 4, 8, 1, 2, 3, 4, 5, 1, 2, 3, 9, 6, 1, 2]
    topk = np.tile(np.arange(20, 28), (len(prompt), 1))
    topk[[i for i, t in enumerate(prompt) if t == 3]] = [4, 9, 20, 21, 22, 23, 24, 25]  # the model after 3
    d = RacerDrafter(n=4, k=8, deep=0)  # the deep chain's nodes are tested on their own
    d.begin(prompt, topk)
    tree = d.draft(3, 40)
    by_token = {tree.tokens[i]: tree.features[i] for i in range(1, len(tree)) if tree.depths[i] == 1}
    # Retrieved: (agreement with the parent's copy-logit row, border depth, freq ratio).
    assert by_token[4] == ("retrieval", 1, 3, 3)  # rank 1 after 3; 3/4 of the time: quarter 3
    assert by_token[9] == ("retrieval", 2, 3, 1)  # rank 2 after 3; 1/4
    below_4 = {tree.tokens[c]: tree.features[c] for c in tree.children[tree.child(0, 4)].values()}
    assert below_4[7][:2] == ("retrieval", 0)  # the row after 4 (20..27) does not hold 7
    # Copy-logit nodes: (rank in the parent's row, depth).
    assert by_token[20] == ("logits", 2, 1) and by_token[23] == ("logits", 5, 1)
    assert tree.features[0] is None
    # Without the copy-logit table nothing can agree.
    d = RacerDrafter(n=4, k=8, sources="retrieval", deep=0)
    d.begin(prompt, None)
    tree = d.draft(3, 40)
    assert tree.features[tree.child(0, 4)] == ("retrieval", 0, 3, 3)


def test_retrieval_evidence_matches_brute_force_counts():
    from racer.drafting.automaton import NgramAutomaton

    n = 5
    rng = np.random.default_rng(3)
    context = [int(t) for t in rng.integers(0, 4, size=200)]
    trie = NgramAutomaton(n=n, capacity=100_000)  # large enough that nothing is evicted
    trie.start(context[:-1])
    root = context[-1]

    def count(s):  # how many full n-token windows of the context start with s
        s = list(s)
        return sum(context[i : i + len(s)] == s for i in range(len(context) - 1 - n + 1))

    found = trie.retrieve(root, 30, 2)
    assert found
    for path, _, border, ratios in found:
        assert len(ratios) == len(path)
        stem = (context[:-1] + [root])[-border:]  # the border is a suffix of context + root
        for i, ratio in enumerate(ratios):
            assert ratio == pytest.approx(count(stem + path[: i + 1]) / count(stem + path[:i]))


def test_a_copy_logit_row_of_minus_ones_writes_nothing():
    """Rows the engine did not compute (``Needs.prompt_rows="latest"``) are -1 and
    leave the table as it was; later rows still overwrite earlier ones."""
    table = CopyLogitTable(3)
    table.write([4, 9, 4], np.array([[1, 2, 3], [5, 6, 7], [-1, -1, -1]]))
    assert table.rows == {4: (1, 2, 3), 9: (5, 6, 7)}
    table.write([4, 4], np.array([[-1, -1, -1], [8, 7, 6]]))
    assert table.row(4) == (8, 7, 6)

