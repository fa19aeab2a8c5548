"""racer's proposer inside vLLM itself (the CPU build, ``make vllm-env``; run with
``make test-vllm``). Skipped where vLLM is not installed: racer's own environment.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the test can
look at the proposer's state."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # custom_class is V1-only
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
vllm = pytest.importorskip("vllm")

from conftest import LOSSLESS_NEW_TOKENS, lossless_questions  # noqa: E402
from racer.bench.questions import load_questions  # noqa: E402
from racer.loading import model_folder  # noqa: E402

RACER = {"method": "custom_class", "model": "racer.integrations.vllm.RacerProposer", "num_speculative_tokens": 16}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}


def chat(question) -> list[dict]:
    return question.chat


class Engine:
    """One vLLM ``LLM`` at a time (each holds its KV cache)."""

    def __init__(self, spec: dict | None, max_num_seqs: int = 8) -> None:
        self.llm = vllm.LLM(model=str(model_folder(None)), dtype="float32", enforce_eager=True,
                            speculative_config=spec, max_model_len=2048, max_num_seqs=max_num_seqs,
                            disable_log_stats=False)

    def greedy(self, prompts: list[list[dict]], tokens: int = LOSSLESS_NEW_TOKENS) -> list[list[int]]:
        params = vllm.SamplingParams(temperature=0, max_tokens=tokens)
        return [list(out.outputs[0].token_ids) for out in self.llm.chat(prompts, params, use_tqdm=False)]

    def accepted(self) -> tuple[int, int]:
        """Draft tokens accepted and drafts made so far (vLLM's spec-decode counters)."""
        values = {m.name: m.value for m in self.llm.get_metrics() if hasattr(m, "value")}
        return (int(values.get("vllm:spec_decode_num_accepted_tokens", 0)),
                int(values.get("vllm:spec_decode_num_drafts", 0)))

    def close(self) -> None:
        del self.llm
        gc.collect()


@pytest.fixture(scope="module")
def plain_outputs():
    questions = lossless_questions()
    engine = Engine(None)
    try:
        yield {"batch": engine.greedy([chat(q) for q in questions]), "questions": questions,
               "sample": {d: engine.greedy([chat(q) for q in load_questions(d)[:4]], 256)
                          for d in ("human_eval", "mgsm")}}
    finally:
        engine.close()


def test_greedy_with_racers_proposer_is_vllms_own_output_batch_1_and_8(plain_outputs):
    # The default method (memory=shared): 8 at once writing one shared memory, then some
    # again alone, drafting from what the first pass wrote.
    questions = plain_outputs["questions"]
    engine = Engine(RACER)
    try:
        assert engine.greedy([chat(q) for q in questions]) == plain_outputs["batch"]  # 8 at once
        alone = [engine.greedy([chat(q)])[0] for q in questions[::3]]  # one at a time
        assert alone == plain_outputs["batch"][::3]
        accepted, drafts = engine.accepted()
        assert accepted > 0 and drafts > 0
    finally:
        engine.close()


def test_the_proposer_follows_requests_through_a_scheduler_with_fewer_rows_than_requests(plain_outputs):
    # Seven requests on two rows: rows are refilled by waiting requests and reordered as
    # others finish; a drafter keyed to the wrong request would only draft badly, so the
    # outputs check vLLM and the drafts' acceptance checks racer (the row bookkeeping
    # itself: tests/test_vllm_core.py).
    questions = plain_outputs["questions"][:7]
    engine = Engine(RACER, max_num_seqs=2)
    try:
        assert engine.greedy([chat(q) for q in questions]) == plain_outputs["batch"][:7]
        accepted, drafts = engine.accepted()
        assert accepted > 0 and drafts > 0
    finally:
        engine.close()


def test_greedy_with_the_kept_memory_method_is_vllms_own_output(plain_outputs, monkeypatch):
    # The proposer's default (the tests above) shares one automaton and copy-logit table
    # that every request writes into while the others decode; memory=kept instead hands
    # a finished request's whole drafter to the next one: vLLM's own output every time.
    monkeypatch.setenv("RACER_VLLM_METHOD", "racer:memory=kept")
    questions = plain_outputs["questions"]
    engine = Engine(RACER)
    try:
        assert engine.greedy([chat(q) for q in questions]) == plain_outputs["batch"]
        alone = [engine.greedy([chat(q)])[0] for q in questions[::3]]
        assert alone == plain_outputs["batch"][::3]
        accepted, drafts = engine.accepted()
        assert accepted > 0 and drafts > 0
    finally:
        engine.close()


def test_racers_proposer_accepts_more_than_vllms_ngram_on_humaneval_and_mgsm(plain_outputs):
    # Last in this file: once an ngram engine has been built in a process, vLLM 0.32
    # fails to build another (its kernel dispatcher). And the counters read are those of
    # the engine built last: each engine here is read before the next is built.
    accepted = {}

    def measure(name: str, engine: Engine) -> None:
        for dataset in ("human_eval", "mgsm"):
            before = engine.accepted()[0]
            prompts = [chat(q) for q in load_questions(dataset)[:4]]
            assert engine.greedy(prompts, 256) == plain_outputs["sample"][dataset]
            accepted[name, dataset] = engine.accepted()[0] - before

    for name, spec in (("racer", RACER), ("ngram", NGRAM)):
        engine = Engine(spec)
        try:
            measure(name, engine)
        finally:
            engine.close()
    # The same tokens come out either way: more accepted drafts = fewer target passes.
    for dataset in ("human_eval", "mgsm"):
        assert accepted["racer", dataset] > accepted["ngram", dataset], accepted
