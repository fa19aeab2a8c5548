"""Drafter memory across requests (``racer.engine.memory``): scoped, bounded, and never
a change to any request's output."""

from __future__ import annotations

import pytest

from conftest import make_tiny_llama
from racer import Decoder
from racer.engine.loop import BatchDecoder
from racer.engine.memory import DrafterPool
from test_batch import tiny_prompts


def test_a_scope_takes_back_what_it_gave_last_and_nothing_of_another_scope():
    pool: DrafterPool = DrafterPool(limit=4)
    built = iter(range(100))
    make = lambda: next(built)  # noqa: E731
    first, second = pool.take("a", make), pool.take("a", make)
    assert (first, second) == (0, 1)
    pool.give_back("a", first)
    pool.give_back("a", second)
    assert pool.take("b", make) == 2  # another scope never sees a's
    assert pool.peek("a") == second and pool.peek("b") is None and len(pool) == 2  # a look takes nothing
    assert pool.take("a", make) == second  # the freshest memory first
    assert pool.take("a", make) == first
    assert pool.take("a", make) == 3


def test_a_score_picks_the_idle_item_and_ties_go_to_the_one_returned_last():
    pool: DrafterPool = DrafterPool(limit=4)
    for item in ("x", "yy", "zz", "www"):
        pool.give_back("a", item)
    pool.give_back("b", "vvvvv")
    assert pool.take("a", lambda: "new", len) == "www"  # another scope's never scores
    assert pool.take("a", lambda: "new", len) == "zz"  # of the two of length 2, the one returned last
    assert pool.take("a", lambda: "new", lambda item: 0) == "yy"  # all tie: the last returned
    assert pool.take("c", lambda: "new", len) == "new"


def test_a_request_takes_the_drafter_of_its_conversation_and_learns_only_what_is_new():
    from racer.drafting import parse_method
    from racer.drafting.automaton import ROOT
    from racer.drafting.tree import DraftTree
    from racer.engine.memory import DrafterMemory

    def count(automaton, window):
        node = ROOT
        for token in window:
            node = automaton.children[node][token]
        return automaton.freq[node]

    memory = DrafterMemory(lambda: parse_method("racer").drafter, rated=True, limit=4)
    talk_a, talk_b = list(range(100, 140)), list(range(200, 240))
    a, b = memory.begin("s", talk_a, None), memory.begin("s", talk_b, None)
    for token in (1, 2, 3):  # each writes an answer
        for session in (a, b):
            session.observe(DraftTree.single(token), None, [0])
    memory.end(a)
    memory.end(b)  # b is handed back last, a holds the conversation resent below
    resent = talk_a + [1, 2, 3] + [50, 51, 52]
    assert a.drafter.holds(resent) == len(talk_a) + 3 and b.drafter.holds(resent) == 0
    again = memory.begin("s", resent, None)
    assert again.drafter is a.drafter
    automaton = again.drafter.automaton
    n = automaton.n
    assert count(automaton, talk_a[:n]) == 1  # the resent text counted once, not once per call
    assert count(automaton, resent[-n:]) == 1  # what is new is learnt
    # A fresh (per-request) drafter keeps nothing to offer.
    fresh = DrafterMemory(lambda: parse_method("racer:memory=fresh").drafter, rated=True, limit=4)
    session = fresh.begin("s", talk_a, None)
    fresh.end(session)
    assert session.drafter.holds(talk_a) == 0


def test_no_scope_keeps_nothing_and_the_pool_is_bounded():
    pool: DrafterPool = DrafterPool(limit=2)
    pool.give_back(None, "x")
    assert len(pool) == 0
    for i in range(5):
        pool.give_back(("user", str(i)), i)
    assert len(pool) == 2 and pool.scopes() == {("user", "3"), ("user", "4")}  # the oldest dropped
    with pytest.raises(ValueError, match="limit"):
        DrafterPool(limit=-1)


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_llama()


def test_requests_of_one_scope_draft_with_one_memory_and_decode_as_alone(tiny_model):
    prompts = tiny_prompts()
    alone = [Decoder(tiny_model, None, "racer:capacity=16").generate(p, max_new_tokens=24).tokens for p in prompts]
    batch = BatchDecoder(tiny_model, None, "racer:capacity=16", max_batch=2, check=False)
    first = batch.submit(prompts[0], max_new_tokens=24, scope="s")
    batch.step()  # prefilled: the request's drafting session begins
    drafter = batch._active[0].session.drafter
    while batch.busy:
        batch.step()
    assert batch.result(first).tokens == alone[0] and batch.idle_drafters == 1
    # The next request of the scope drafts with the same drafter, whose automaton holds
    # what the first request saw; the output is what decoding it alone gives.
    second = batch.submit(prompts[1], max_new_tokens=24, scope="s")
    other = batch.submit(prompts[2], max_new_tokens=24, scope="t")
    batch.step()
    batch.step()
    assert batch._active[0].session.drafter is drafter and batch.idle_drafters == 0
    assert batch._active[1].session.drafter is not drafter
    unscoped = batch.submit(prompts[3], max_new_tokens=24)
    while batch.busy:
        batch.step()
    assert [batch.result(i).tokens for i in (second, other, unscoped)] == [alone[1], alone[2], alone[3]]
    assert batch.idle_drafters == 2 and batch.memory.pool.scopes() == {"s", "t"}


def test_a_fresh_decoder_keeps_the_idle_drafters(tiny_model):
    batch = BatchDecoder(tiny_model, None, "pld", max_batch=2, check=False)
    batch.generate_all(tiny_prompts()[:1], max_new_tokens=4)  # no scope: nothing kept
    assert batch.idle_drafters == 0
    done = batch.submit(tiny_prompts()[1], max_new_tokens=4, scope="server")
    while batch.busy:
        batch.step()
    batch.result(done)
    assert batch.fresh().memory is batch.memory and batch.idle_drafters == 1


def test_a_session_runs_begin_draft_observe_end_once():
    from racer.drafting import parse_method
    from racer.drafting.tree import DraftTree
    from racer.engine.memory import DrafterMemory

    built = []

    def build():
        built.append(parse_method("pld").drafter)
        return built[-1]

    memory = DrafterMemory(build, rated=True, limit=2)
    session = memory.begin("s", [1, 2, 3, 1, 2], None)
    tree = session.draft(3, 4)
    assert list(tree.tokens[:2]) == [3, 1]  # prompt lookup saw the prompt at begin
    session.observe(tree, None, [0, 1])
    assert session.acceptance.counts  # the acceptance model learnt from the step
    paused = memory.begin("t", [7, 8], None)
    paused.observe(DraftTree.single(8), None, [0], rated=False)
    assert not paused.acceptance.counts  # a bare root verified while drafting paused teaches nothing
    assert memory.end(session) == {} and len(memory) == 1
    with pytest.raises(RuntimeError, match="ended twice"):
        memory.end(session)
    assert memory.begin("s", [4], None).drafter is built[0] and len(built) == 2


def test_shared_rates_are_one_model_per_scope_that_every_session_of_it_teaches():
    from racer.drafting import parse_method
    from racer.drafting.tree import DraftTree
    from racer.engine.memory import DrafterMemory

    memory = DrafterMemory(lambda: parse_method("pld").drafter, rated=True, limit=4, scopes=2, shared_rates=True)
    a, b = memory.begin("s", [1, 2, 3, 1, 2], None), memory.begin("s", [5, 6], None)
    assert a.acceptance is b.acceptance and a.drafter is not b.drafter
    a.observe(a.draft(3, 4), None, [0, 1])
    assert b.acceptance.counts  # what a's step showed rates b's nodes too
    other = memory.begin("t", [7], None)
    assert other.acceptance is not a.acceptance and not other.acceptance.counts
    alone = memory.begin(None, [7], None)
    assert alone.acceptance not in (a.acceptance, other.acceptance)  # no scope: rates of its own
    memory.end(a)
    again = memory.begin("s", [9], None)
    assert again.drafter is a.drafter and again.acceptance is b.acceptance  # the scope's, not the drafter's
    memory.begin("u", [7], None)
    assert set(memory.rates) == {"s", "u"}  # the least recently begun scope's rates go first
    # Without shared rates each drafter keeps its own model, as before.
    own = DrafterMemory(lambda: parse_method("pld").drafter, rated=True, limit=4)
    assert own.begin("s", [1], None).acceptance is not own.begin("s", [2], None).acceptance
