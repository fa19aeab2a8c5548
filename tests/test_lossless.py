"""Lossless: on the real embedded model in float32, every method emits exactly the
tokens of Hugging Face greedy `generate` on the benchmark prompts."""

from __future__ import annotations

import pytest

from conftest import LOSSLESS_NEW_TOKENS, hf_greedy, lossless_questions
from racer.engine import Decoder, encode_prompt

QUESTIONS = lossless_questions()

# Methods checked on every prompt. Decoders live for the whole session, so a drafter
# that keeps memory across requests is checked with that memory in place.
METHODS = ["none", "pld"]
# RACER settings take turns over the prompts (each prompt gets one, each setting six
# prompts across the datasets) to keep the real-model suite within its time budget.
RACER_SETTINGS = ["racer:capacity=64", "racer:capacity=16:memory=fresh", "racer:capacity=8",
                  "racer:capacity=64:memory=fresh", "racer:capacity=16", "racer:capacity=8:memory=fresh"]


@pytest.fixture(scope="session")
def decoders(real):
    model, tokenizer = real
    return {method: Decoder(model, tokenizer, method) for method in METHODS + RACER_SETTINGS}


def test_prompt_set_covers_every_category():
    spec = {q.category for q in QUESTIONS if q.dataset == "spec_bench"}
    assert len(spec) == 13 and len(QUESTIONS) == 26 + 5 + 5


def test_every_racer_setting_gets_prompts_from_several_datasets():
    for i, setting in enumerate(RACER_SETTINGS):
        assert len({q.dataset for q in QUESTIONS[i :: len(RACER_SETTINGS)]}) >= 2, setting


@pytest.mark.parametrize("index", range(len(QUESTIONS)), ids=[q.key for q in QUESTIONS])
def test_every_method_matches_hf_greedy(real, decoders, index):
    model, tokenizer = real
    question = QUESTIONS[index]
    ids = encode_prompt(tokenizer, [{"role": "user", "content": question.prompt}], chat=True)
    reference = hf_greedy(model, ids, LOSSLESS_NEW_TOKENS)
    mismatched = {}
    for method in METHODS + [RACER_SETTINGS[index % len(RACER_SETTINGS)]]:
        result = decoders[method].generate(ids, max_new_tokens=LOSSLESS_NEW_TOKENS)
        if result.tokens != reference:
            first = next((i for i, (a, b) in enumerate(zip(result.tokens, reference)) if a != b),
                         min(len(result.tokens), len(reference)))
            mismatched[method] = f"first difference at token {first} of {len(reference)}"
    assert not mismatched, mismatched
