import numpy as np
import pytest

from racer.drafting import make_drafter
from racer.drafting.pld import PromptLookupDrafter


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


#             0  1  2  3  4  5  6  7  8   (+ root 3)
VARIANT_CTX = [2, 3, 7, 1, 2, 3, 5, 1, 2]


def test_original_takes_the_three_gram_whose_continuation_starts_before_the_suffix():
    d = PromptLookupDrafter()  # variant original: n = 3
    d.begin(VARIANT_CTX, None)
    # context + root ends (1, 2, 3); its only earlier match starts at 3.
    assert d.draft(3, 100).tokens == (3, 5, 1, 2, 3)


def test_hf_variant_takes_the_leftmost_two_gram():
    d = make_drafter("pld:variant=hf")
    assert d.max_ngram == 2
    d.begin(VARIANT_CTX, None)
    # (2, 3) first occurs at 0; the continuation runs on into the matched suffix.
    assert d.draft(3, 100).tokens == (3, 7, 1, 2, 3, 5, 1, 2, 3)


def test_hf_variant_may_continue_into_the_suffix_itself():
    # context + root = (5, 6, 5, 6, 5): n = 2 suffix (6, 5) first at 1, continuation
    # starts at 3, inside the suffix region the original forbids.
    hf, original = PromptLookupDrafter(variant="hf"), PromptLookupDrafter(max_ngram=2)
    for d in (hf, original):
        d.begin([5, 6, 5, 6], None)
    assert hf.draft(5, 100).tokens == (5, 6, 5)
    # original: (6, 5) needs start + 2 < 5 - 2, so start 0 only: no; n = 1: (5) at 0 -> 6, 5, 6, 5
    assert original.draft(5, 100).tokens == (5, 6, 5, 6, 5)


def test_end_tokens_keep_or_cut_the_draft_by_variant():
    original, hf = PromptLookupDrafter(), PromptLookupDrafter(variant="hf")
    for d in (original, hf):
        d.attach(None, {5})
        d.begin(VARIANT_CTX, None)
    assert original.draft(3, 100).tokens == (3, 5)  # stops at the end token, keeping it
    assert hf.draft(3, 100).tokens == (3, 7, 1, 2, 3)  # HF cuts just before it


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        make_drafter("pld:variant=vllm")
