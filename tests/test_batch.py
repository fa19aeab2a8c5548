"""Continuous batching (``racer.engine.loop``): every request's output is the output of
decoding it alone, whatever else is in the batch, whoever joins or leaves mid-way."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import LOSSLESS_NEW_TOKENS, hf_greedy, lossless_questions, make_tiny_llama
from families import FAMILIES, build, prompts as family_prompts, shared_cost
from racer import Decoder
from racer.engine import encode_prompt
from racer.engine.loop import BatchDecoder

TINY_LENGTHS = (5, 12, 20, 8, 30, 3, 16, 9)


def tiny_prompts(vocab: int = 97) -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for length in TINY_LENGTHS:
        phrase = [int(t) for t in rng.integers(3, vocab, size=6)]
        out.append((phrase * 10)[:length])
    return out


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_llama()


@pytest.mark.parametrize("spec", ["none", "pld", "racer:capacity=16", "racer", "token-recycling", "logitspec"])
def test_every_request_decodes_as_it_would_alone(tiny_model, spec):
    """8 requests of mixed lengths through 4 rows: half join as others leave, prompts
    prefilled in chunks of 7 tokens."""
    prompts = tiny_prompts()
    alone = [Decoder(tiny_model, None, spec, cost=shared_cost()).generate(p, max_new_tokens=24).tokens
             for p in prompts]
    batch = BatchDecoder(tiny_model, None, spec, max_batch=4, prefill_chunk=7, cost=shared_cost())
    results = batch.generate_all(prompts, max_new_tokens=24)
    assert [r.tokens for r in results] == alone
    assert [r.tokens for r in results] == [hf_greedy(tiny_model, p, 24) for p in prompts]
    if spec != "none":
        assert sum(s.accepted for r in results for s in r.steps) > 0


@pytest.mark.parametrize("label", ["Gemma 2", "GPT-Neo (global + local layers)", "Llama 4 (chunked)",
                                   "Gemma 3n (KV-shared layers)", "Mistral (sliding window)"])
def test_windowed_families_batch_losslessly_past_their_windows(label):
    model = build(next(f for f in FAMILIES if f.label == label))
    prompts = [family_prompts(128, seed)["long"][:length] for seed, length in enumerate((40, 10, 33, 6, 25, 18))]
    batch = BatchDecoder(model, None, "racer:capacity=16", max_batch=3, prefill_chunk=9)
    results = batch.generate_all(prompts, max_new_tokens=32)
    assert [r.tokens for r in results] == [Decoder(model, None, "racer:capacity=16").generate(
        p, max_new_tokens=32).tokens for p in prompts]


def test_a_cancelled_request_frees_its_row_and_the_others_go_on(tiny_model):
    prompts = tiny_prompts()[:4]
    alone = [Decoder(tiny_model, None, "racer:capacity=16").generate(p, max_new_tokens=24).tokens for p in prompts]
    batch = BatchDecoder(tiny_model, None, "racer:capacity=16", max_batch=4)
    ids = [batch.submit(p, max_new_tokens=24) for p in prompts]
    for _ in range(6):
        batch.step()
    batch.cancel(ids[1])
    while batch.busy:
        batch.step()
    cancelled = batch.result(ids[1])
    assert cancelled.stop_reason == "cancelled" and len(cancelled.tokens) < 24
    assert [batch.result(i).tokens for i in (ids[0], ids[2], ids[3])] == [alone[0], alone[2], alone[3]]
    assert batch.rows.lengths == [] and batch.active == 0


@pytest.mark.parametrize("max_batch, joined, held", [(8, 3, 4), (8, 5, 8), (3, 3, 3), (8, 1, 1)])
def test_the_slot_cache_grows_its_rows_by_doubling_up_to_the_batch(tiny_model, max_batch, joined, held):
    """Rows are allocated 1, 2, 4, ... up to ``max_batch`` (each growth copies every
    layer's buffers), never past it."""
    batch = BatchDecoder(tiny_model, None, "none", max_batch=max_batch, cost=shared_cost())
    for prompt in tiny_prompts()[:joined]:
        batch.submit(prompt, max_new_tokens=24)
    while batch.waiting:
        batch.step()
    assert batch.active == joined
    assert {layer._keys.shape[0] for layer in batch.rows.slots.slot_layers} == {held}


def test_stop_and_limits_end_each_request_on_its_own(tiny_model):
    prompts = tiny_prompts()[:3]
    batch = BatchDecoder(tiny_model, None, "pld", max_batch=3)
    ids = [batch.submit(p, max_new_tokens=n) for p, n in zip(prompts, (1, 5, 17))]
    updates = []
    while batch.busy:
        updates += batch.step()
    results = [batch.result(i) for i in ids]
    assert [len(r.tokens) for r in results] == [1, 5, 17]
    assert all(r.stop_reason == "length" for r in results)
    for i, result in zip(ids, results):  # every request ends with exactly one update saying so
        assert [u.done for u in updates if u.request == i].count(True) == 1
        assert sum((u.tokens for u in updates if u.request == i), []) == result.tokens
    with pytest.raises(KeyError, match="has not finished"):
        batch.result(ids[0])  # handed over once: nothing of a request stays


@pytest.mark.parametrize("spec", ["racer:capacity=16", "token-recycling:capacity=16", "logitspec:capacity=16"])
def test_a_seed_repeats_a_sampled_request(tiny_model, spec):
    prompt = tiny_prompts()[2]
    runs = []
    for _ in range(2):
        batch = BatchDecoder(tiny_model, None, spec, max_batch=2)
        result = batch.generate_all([prompt, tiny_prompts()[4]], max_new_tokens=48, temperature=0.7, seed=7)[0]
        runs.append(result.tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 48
    assert sum(s.accepted for s in result.steps) > 0  # drafts were accepted while sampling


@pytest.mark.parametrize("kwargs, pattern", [
    ({"method": 3}, "method"), ({"max_batch": 0}, "max_batch"), ({"prefill_chunk": True}, "prefill_chunk"),
    ({"memory_limit": -1}, "limit"), ({"method": "nope"}, "method"),
])
def test_bad_arguments_name_themselves(tiny_model, kwargs, pattern):
    arguments = {"method": "pld", **kwargs}
    with pytest.raises(ValueError, match=pattern):
        BatchDecoder(tiny_model, None, arguments.pop("method"), **arguments)


def test_a_batched_step_reads_the_device_once(tiny_model, monkeypatch):
    import racer.engine.loop as batching

    reads = []
    real = batching.to_host
    monkeypatch.setattr(batching, "to_host", lambda tensor: reads.append(1) or real(tensor))
    batch = BatchDecoder(tiny_model, None, "racer:capacity=16", max_batch=8)
    for prompt in tiny_prompts():
        batch.submit(prompt, max_new_tokens=12)
    while batch.waiting:  # prefills (one read each, for the first token's top-k)
        batch.step()
    before = len(reads)
    steps = 0
    while batch.busy:
        batch.step()
        steps += 1
    assert len(reads) - before == steps


def test_real_model_requests_batch_losslessly(real):
    model, tokenizer = real
    questions = lossless_questions()[::5][:8]
    prompts = [encode_prompt(tokenizer, q.chat, chat=True) for q in questions]
    decoder = Decoder(model, tokenizer, "racer")
    decoder.calibrate()
    batch = BatchDecoder(model, tokenizer, "racer", max_batch=8, prefill_chunk=64, cost=decoder.cost)
    tokens = LOSSLESS_NEW_TOKENS // 2
    results = batch.generate_all(prompts, max_new_tokens=tokens)
    assert [r.tokens for r in results] == [hf_greedy(model, p, tokens) for p in prompts]


def test_a_step_that_holds_one_request_is_chosen_per_node(tiny_model, monkeypatch):
    # Alone in a batch engine, a request's tree is chosen as a lone Decoder's is (per
    # node); two or more share the batch's cap.
    from racer.budget import BatchBudget, DraftBudget

    batch = BatchDecoder(tiny_model, None, "racer", max_batch=2, cost=shared_cost(), check=False)
    assert isinstance(batch.budget, BatchBudget) and isinstance(batch.lone_budget, DraftBudget)
    chosen = []
    for name, budget in (("lone", batch.lone_budget), ("batch", batch.budget)):
        real = budget.select
        monkeypatch.setattr(budget, "select", lambda trees, *rest, real=real, name=name:
                            chosen.append((name, len(trees))) or real(trees, *rest))
    prompts = tiny_prompts()[:2]
    alone = [Decoder(tiny_model, None, "racer", cost=shared_cost(), check=False).generate(p, max_new_tokens=16).tokens
             for p in prompts]
    assert batch.generate_all(prompts[:1], max_new_tokens=16)[0].tokens == alone[0]
    assert chosen and set(chosen) == {("lone", 1)}
    chosen.clear()
    assert [r.tokens for r in batch.generate_all(prompts, max_new_tokens=16)] == alone
    assert ("batch", 2) in chosen and all(n == 1 for name, n in chosen if name == "lone")
    assert BatchDecoder(tiny_model, None, "racer:capacity=8", max_batch=2, cost=shared_cost(),
                        check=False).lone_budget is None  # a fixed capacity verifies every node


def test_requests_that_wait_together_prefill_in_one_pass_and_decode_as_alone(real):
    """Three requests that arrive while another decodes: their prompts' last chunks
    share one pass within the step's bound, so each one's first token leaves in the same
    step, and every answer is the answer alone."""
    model, tokenizer = real
    questions = lossless_questions()[1::5][:4]
    prompts = [encode_prompt(tokenizer, q.chat, chat=True) for q in questions]
    assert sum(len(p) for p in prompts[1:]) <= 512  # the engine's default bound a step
    decoder = Decoder(model, tokenizer, "racer")
    decoder.calibrate()
    batch = BatchDecoder(model, tokenizer, "racer", max_batch=4, cost=decoder.cost)
    tokens = 48
    ids = [batch.submit(prompts[0], max_new_tokens=tokens)]
    batch.step()
    assert batch.active == 1
    ids += [batch.submit(p, max_new_tokens=tokens) for p in prompts[1:]]
    passes = []
    real_prefill = batch.rows.prefill
    batch.rows.prefill = lambda chunks: passes.append(len(chunks)) or real_prefill(chunks)
    started = {u.request for u in batch.step() if u.step == 0 and u.tokens}
    assert started == set(ids[1:]) and passes == [3] and batch.active == 4
    while batch.busy:
        batch.step()
    assert [batch.result(i).tokens for i in ids] == [hf_greedy(model, p, tokens) for p in prompts]
