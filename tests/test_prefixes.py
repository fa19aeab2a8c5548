"""Prompts' and finished requests' KV kept for later prompts that begin with the same tokens
(``racer.engine.prefixes``): the store's rules on toys, and on the real model an agent
session's calls decoded from kept prefixes exactly as with every prompt prefilled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_tiny_llama
from families import shared_cost

from racer.engine.loop import BatchDecoder
from racer.engine.prefixes import Prefix, PrefixStore, common_prefix


def prefix(tokens: list[int], width: int = 4) -> Prefix:
    kv = [(torch.zeros(2, len(tokens), width), torch.zeros(2, len(tokens), width)) for _ in range(3)]
    return Prefix(np.asarray(tokens, dtype=np.int64), kv)


def test_common_prefix_counts_the_leading_tokens_two_sequences_share():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, np.array([1, 2, 9, 4])) == 2
    assert common_prefix(a, np.array([7])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


def test_the_longest_kept_prefix_of_the_scope_is_given_never_the_whole_prompt():
    store = PrefixStore(1 << 20, minimum=3)
    store.put("a", prefix([1, 2, 3, 4, 5, 6]))
    store.put("a", prefix([1, 2, 3, 9, 9]))
    store.put("b", prefix([1, 2, 3, 4, 5, 6, 7, 8]))
    found, length = store.longest("a", [1, 2, 3, 4, 5, 6, 7])
    assert length == 6 and list(found.tokens) == [1, 2, 3, 4, 5, 6]
    found, length = store.longest("a", [1, 2, 3, 4, 5, 6])  # all of it kept: the last token is computed
    assert length == 5
    assert store.longest("a", [1, 2, 8, 8]) == (None, 0)  # 2 shared: under the minimum
    assert store.longest("c", [1, 2, 3, 4, 5, 6, 7]) == (None, 0)  # another scope's KV is never given
    assert store.longest(None, [1, 2, 3, 4, 5, 6, 7]) == (None, 0)
    assert not store.wants(None, 100) and not store.wants("a", 2) and store.wants("a", 3)
    assert store.reused == 6 + 5


def test_the_store_says_whether_a_kept_prefix_of_the_scope_already_holds_the_tokens():
    store = PrefixStore(1 << 20, minimum=3)
    store.put("a", prefix([1, 2, 3, 4, 5]))
    assert store.holds("a", [1, 2, 3, 4]) and store.holds("a", [1, 2, 3, 4, 5])
    assert not store.holds("a", [1, 2, 3, 4, 5, 6]) and not store.holds("a", [1, 2, 9])
    assert not store.holds("b", [1, 2, 3])  # another scope's


def test_the_store_says_what_it_would_give_without_using_it():
    store = PrefixStore(1 << 20, minimum=3)
    store.put("a", prefix([1, 2, 3, 4, 5]))
    store.put("a", prefix([7, 7, 7, 7]))
    assert store.reusable("a", [1, 2, 3, 4, 9]) == 4 and store.reusable("a", [1, 2, 9]) == 0
    assert store.reusable("b", [1, 2, 3, 4, 9]) == 0 and store.reusable(None, [1, 2, 3, 4, 9]) == 0
    assert store.reused == 0 and [list(p.tokens) for _, p in store._entries.values()][0] == [1, 2, 3, 4, 5]


def test_a_prompt_waits_for_one_prefilled_in_its_step_that_it_shares_more_with_than_with_any_kept():
    """Two prompts of one scope that share 80 leading tokens arrive together: the second
    waits one step, for the first's prompt to be kept, and computes only the rest; a
    prompt behind it waits in turn (in order), then joins in the same step as it."""
    model = make_tiny_llama()
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, 97, size=80)]
    prompts = [shared + [5, 6, 7], shared + [8, 9], [int(t) for t in rng.integers(3, 97, size=30)]]
    batch = BatchDecoder(model, None, "none", max_batch=4, prefix_cache_mib=16, cost=shared_cost(), check=False)
    ids = [batch.submit(prompts[0], scope="s", max_new_tokens=8), batch.submit(prompts[1], scope="s", max_new_tokens=8),
           batch.submit(prompts[2], max_new_tokens=8)]
    assert {u.request for u in batch.step() if u.step == 0} == {ids[0]}
    assert {u.request for u in batch.step() if u.step == 0} == {ids[1], ids[2]}
    while batch.busy:
        batch.step()
    results = [batch.result(i) for i in ids]
    assert [r.prompt_reused for r in results] == [0, 80, 0]
    assert [r.tokens for r in results] == [hf_greedy(model, p, 8) for p in prompts]


def test_the_store_is_bounded_in_bytes_least_recently_used_out_first():
    one = prefix([1] * 10).nbytes
    store = PrefixStore(3 * one, minimum=2)
    for first in range(3):
        store.put("s", prefix([first] + [7] * 9))
    assert len(store) == 3 and store.held == 3 * one
    store.longest("s", [0] + [7] * 9 + [5])  # the oldest is used: now the most recent
    store.put("s", prefix([3] + [7] * 9))
    assert len(store) == 3 and store.held <= store.capacity
    assert store.longest("s", [1] + [7] * 9 + [5]) == (None, 0)  # the least recently used went
    assert store.longest("s", [0] + [7] * 9 + [5])[1] == 10
    kept = len(store)
    store.put("s", prefix([3] + [7] * 9 + [8, 8]))  # extends a kept one: that one goes (and, to fit, the oldest)
    assert len(store) == kept - 1 and store.held <= store.capacity
    found, length = store.longest("s", [3] + [7] * 9 + [8, 8, 1])
    assert length == 12 and len(found.tokens) == 12
    assert PrefixStore(one - 1).put("s", prefix([1] * 10)) is None  # too big: not kept
    with pytest.raises(ValueError, match="capacity"):
        PrefixStore(-1)
    with pytest.raises(ValueError, match="minimum"):
        PrefixStore(10, minimum=0)


def test_an_agent_sessions_calls_from_kept_prefixes_decode_as_with_full_prefills(real):
    """Each call of a session resends the conversation: from the second on, the prompt
    begins with the last call's, whose KV was kept; greedy answers are those of
    prefilling every prompt whole, and of plain greedy decoding."""
    from racer import BatchDecoder, encode_prompt
    from racer.bench.questions import load_questions

    model, tokenizer = real
    calls = load_questions("agent_sessions", 1)
    answers = {}
    for mib in (0, 64):
        decoder = BatchDecoder(model, tokenizer, "racer", max_batch=2, check=False, prefix_cache_mib=mib)
        got = []
        for call in calls:
            request = decoder.submit(call.chat, max_new_tokens=24, scope="session")
            while decoder.busy:
                decoder.step()
            result = decoder.result(request)
            got.append((result.tokens, result.prompt_reused))
        answers[mib] = got
    assert [tokens for tokens, _ in answers[64]] == [tokens for tokens, _ in answers[0]]
    reused = [r for _, r in answers[64]]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]) and all(r == 0 for _, r in answers[0])
    last = encode_prompt(tokenizer, calls[-1].chat, chat=True)
    assert answers[64][-1][0] == hf_greedy(model, last, 24)
    # Other scopes and requests without one neither keep nor reuse.
    decoder = BatchDecoder(model, tokenizer, "none", max_batch=2, check=False, prefix_cache_mib=64)
    for scope in ("first", "second", None):
        request = decoder.submit(calls[1].chat, max_new_tokens=4, scope=scope)
        while decoder.busy:
            decoder.step()
        assert decoder.result(request).prompt_reused == 0
    with pytest.raises(ValueError, match="prefix_cache_mib"):
        BatchDecoder(model, tokenizer, "none", max_batch=2, check=False, prefix_cache_mib=-1)


def test_a_prompt_is_kept_once_prefilled_for_requests_that_arrive_while_it_decodes(real):
    """Two agent sessions' first calls sent together share their system prompt: the
    second starts from the first's prompt, kept when its prefill was done (the first is
    still decoding), and both answers are plain greedy decoding's."""
    from racer import BatchDecoder, encode_prompt
    from racer.bench.questions import load_questions
    from racer.engine.prefixes import common_prefix

    model, tokenizer = real
    firsts = {}
    for call in load_questions("agent_sessions"):
        firsts.setdefault(call.session, call.chat)
        if len(firsts) == 2:
            break
    prompts = [encode_prompt(tokenizer, chat, chat=True) for chat in firsts.values()]
    shared = common_prefix(np.asarray(prompts[0]), np.asarray(prompts[1]))
    assert shared >= 64  # one system prompt
    decoder = BatchDecoder(model, tokenizer, "racer", max_batch=2, check=False, prefix_cache_mib=64)
    requests = [decoder.submit(chat, max_new_tokens=16, scope="server") for chat in firsts.values()]
    while decoder.busy:
        decoder.step()
    results = [decoder.result(r) for r in requests]
    assert [r.prompt_reused for r in results] == [0, shared]
    for prompt, result in zip(prompts, results):
        assert result.tokens == hf_greedy(model, prompt, 16)
