"""The deep chain's index (``racer.drafting.context_match``) against a brute-force
search, and the chain in RACER's trees."""

import numpy as np
import pytest

from racer.drafting.context_match import ContextMatch
from racer.drafting.racer import RacerDrafter
from racer.drafting.tree import RETRIEVAL


def brute_force(context, root, key, per_key, reach, limit):
    """Among the ``per_key`` most recent earlier ends of the last ``key`` tokens of
    context + root, the one with the longest match (capped at ``reach``; ties: the most
    recent), and the tokens after it."""
    text = list(context) + [root]
    here = len(context)
    ends = [e for e in range(key - 1, here) if text[e - key + 1 : e + 1] == text[here - key + 1 :]][-per_key:]
    best = None
    for end in reversed(ends):
        length = 0
        while length < reach and end - length >= 0 and text[end - length] == text[here - length]:
            length += 1
        if best is None or length > best[0]:
            best = (length, end)
    if best is None:
        return None
    after = text[best[1] + 1 : best[1] + 1 + limit]
    return (best[0], after) if after else None


@pytest.mark.parametrize("seed", range(40))
def test_longest_earlier_match_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    alphabet, size = int(rng.integers(2, 6)), int(rng.integers(1, 300))
    key, per_key, reach, limit = int(rng.integers(1, 5)), int(rng.integers(1, 10)), 0, int(rng.integers(1, 40))
    reach = key + int(rng.integers(0, 30))
    context = [int(t) for t in rng.integers(0, alphabet, size=size)]
    index = ContextMatch(key, per_key, reach)
    index.extend(context[: size // 2])
    for token in context[size // 2 :]:  # grown one token at a time, as a request is
        index.append(token)
    for root in range(alphabet):
        found = index.longest(root, limit)
        expected = brute_force(context, root, key, per_key, reach, limit)
        assert (None if found is None else (found.length, found.continuation)) == expected, (root, context)


def test_a_repeat_with_a_short_period_runs_into_the_root():
    index = ContextMatch(key=2)
    index.extend([7, 1, 2, 1, 2, 1])
    match = index.longest(2, 10)  # context + root "7 1 2 1 2 1 2": "1 2 1 2" ended at position 4
    assert match.length == 4 and match.continuation == [1, 2]  # position 5, then the root itself


def test_bad_options_are_named():
    for kwargs, name in (({"key": 0}, "key"), ({"per_key": 0}, "per_key"), ({"key": 4, "reach": 3}, "reach")):
        with pytest.raises(ValueError, match=name):
            ContextMatch(**kwargs)
    with pytest.raises(ValueError, match="deep"):
        RacerDrafter(deep=-1)


def run_of(length, start=100):
    return list(range(start, start + length))


def test_racer_drafts_the_long_match_first_as_one_chain():
    copied = run_of(40)
    prompt = [1, 2] + copied + [3, 4] + copied[:5]  # the answer starts copying the run again
    topk = np.tile(np.arange(20, 28), (len(prompt), 1))
    drafter = RacerDrafter(n=4, k=8, deep=16)
    drafter.begin(prompt, topk)
    tree = drafter.draft(copied[5], 64)
    chain = [i for i in range(1, len(tree)) if tree.features[i][0] == "context"]
    # The 16 tokens after the first occurrence of ... 104 105, each node one deeper.
    assert [tree.tokens[i] for i in chain] == copied[6:22]
    assert [tree.depths[i] for i in chain] == list(range(1, 17))
    assert all(tree.sources[i] & RETRIEVAL for i in chain)
    # Matched behind the parent: 6 tokens (100..105), then one more per chain token.
    assert tree.features[chain[0]] == ("context", (6).bit_length(), 0)
    assert tree.features[chain[-1]] == ("context", (6 + 15).bit_length(), 0)
    # The n-gram automaton alone reaches n - border tokens past the match.
    plain = RacerDrafter(n=4, k=8, deep=0)
    plain.begin(prompt, topk)
    assert max(plain.draft(copied[5], 64).depths) < 16


def test_the_chain_counts_what_it_gave_and_follows_accepted_tokens():
    copied = run_of(30)
    prompt = copied + [5] + copied[:4]
    drafter = RacerDrafter(n=4, k=8, deep=8)
    drafter.begin(prompt, np.tile(np.arange(20, 28), (len(prompt), 1)))
    tree = drafter.draft(copied[4], 64)
    accepted = [0] + [tree.child(0, copied[5])]
    accepted.append(tree.child(accepted[-1], copied[6]))
    drafter.observe(tree, np.tile(np.arange(20, 28), (len(tree), 1)), accepted)
    assert drafter.request_stats()["accepted_deep"] == 2
    nxt = drafter.draft(copied[7], 64)  # the context now ends ... 104 105 106, root 107
    assert [nxt.tokens[i] for i in range(1, len(nxt)) if nxt.features[i][0] == "context"] == copied[8:16]


def test_no_chain_in_chain_mode_or_without_retrieval():
    copied = run_of(30)
    prompt = copied + [5] + copied[:4]
    topk = np.tile(np.arange(20, 28), (len(prompt), 1))
    for options in ({"chain": True}, {"sources": "logits"}, {"deep": 0}):
        drafter = RacerDrafter(n=4, k=8, **options)
        drafter.begin(prompt, topk)
        tree = drafter.draft(copied[4], 64)
        assert not any(f and f[0] == "context" for f in tree.features), options


def test_real_agent_call_copies_its_prompt_through_the_chain_losslessly(real):
    """An agent session's last call (the whole conversation resent): the deep chain
    drafts most of what is accepted, and the answer is greedy ``generate``'s."""
    from conftest import LOSSLESS_NEW_TOKENS, hf_greedy
    from racer.bench.questions import load_questions
    from racer.engine import Decoder, encode_prompt

    model, tokenizer = real
    question = load_questions("agent_sessions", limit=4)[-1]
    ids = encode_prompt(tokenizer, question.chat, chat=True)
    result = Decoder(model, tokenizer, "racer:memory=fresh").generate(ids, max_new_tokens=LOSSLESS_NEW_TOKENS)
    assert result.tokens == hf_greedy(model, ids, LOSSLESS_NEW_TOKENS)
    accepted = sum(step.accepted for step in result.steps)
    assert result.drafter_stats["accepted_deep"] > accepted / 3 > 0
