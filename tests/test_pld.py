import numpy as np

from racer.drafters import make_drafter
from racer.drafters.pld import PromptLookupDrafter


def test_longest_ngram_first_then_leftmost_match():
    d = PromptLookupDrafter(max_ngram=3, num_tokens=4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    ctx = np.array([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2])
    d.begin(ctx.tolist(), None)
    # context + root 3 ends in (1, 2, 3); its leftmost earlier match starts at 0.
    assert d.draft(3, 100).tokens == (3, 9, 8, 1, 2)
    # root 5 matches nothing at n=3,2 ((2,5) is new); n=1: 5 never occurred.
    assert d.draft(5, 100).tokens == (5,)


def test_budget_limits_the_chain_and_observe_extends_the_context():
    d = PromptLookupDrafter(max_ngram=2, num_tokens=10)
    d.begin([4, 5, 6, 7, 8], None)
    assert d.draft(6, 3).tokens == (6, 7, 8)  # budget 3 nodes: root + 2
    tree = d.draft(1, 10)
    assert tree.tokens == (1,)
    d.observe(tree, None, [0])  # context now ends with 1
    assert d.draft(4, 10).tokens == (4, 5, 6, 7, 8, 1, 4)


def test_options_are_parsed_from_the_method_string():
    d = make_drafter("pld:max_ngram=2:num_tokens=5")
    assert (d.max_ngram, d.num_tokens) == (2, 5)
