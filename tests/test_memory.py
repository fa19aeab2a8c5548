"""Drafter memory across requests (``racer.engine.memory``): scoped, bounded, and never
a change to any request's output."""

from __future__ import annotations

import pytest

from conftest import make_tiny_llama
from racer import Decoder
from racer.engine.batch import BatchDecoder
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
    assert pool.take("a", make) == second  # the freshest memory first
    assert pool.take("a", make) == first
    assert pool.take("a", make) == 3


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
    drafter = batch._waiting[0].drafter
    while batch.busy:
        batch.step()
    assert batch.result(first).tokens == alone[0] and len(batch.pool) == 1
    # The next request of the scope drafts with the same drafter, whose automaton holds
    # what the first request saw; the output is what decoding it alone gives.
    second = batch.submit(prompts[1], max_new_tokens=24, scope="s")
    assert batch._waiting[0].drafter is drafter and len(batch.pool) == 0
    other = batch.submit(prompts[2], max_new_tokens=24, scope="t")
    assert batch._waiting[1].drafter is not drafter
    unscoped = batch.submit(prompts[3], max_new_tokens=24)
    while batch.busy:
        batch.step()
    assert [batch.result(i).tokens for i in (second, other, unscoped)] == [alone[1], alone[2], alone[3]]
    assert len(batch.pool) == 2 and batch.pool.scopes() == {"s", "t"}


def test_a_fresh_decoder_keeps_the_idle_drafters(tiny_model):
    batch = BatchDecoder(tiny_model, None, "pld", max_batch=2, check=False)
    batch.generate_all(tiny_prompts()[:1], max_new_tokens=4)  # no scope: nothing kept
    assert len(batch.pool) == 0
    done = batch.submit(tiny_prompts()[1], max_new_tokens=4, scope="server")
    while batch.busy:
        batch.step()
    batch.result(done)
    assert batch.fresh().pool is batch.pool and len(batch.pool) == 1
