"""Lossless: on the real embedded model in float32, every method emits exactly the
tokens of Hugging Face greedy `generate` on the benchmark prompts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import LOSSLESS_NEW_TOKENS, TEST_DEVICE, hf_greedy, lossless_questions
from racer.engine.calibration import load_or_measure
from racer.engine import Decoder, encode_prompt
from racer.fastpaths.kernels import packed_weights

QUESTIONS = lossless_questions()
REPO = Path(__file__).resolve().parents[1]

# Checked on every prompt (cheap: one chain per step).
EVERY_PROMPT = ["pld"]
# Tree methods take turns over the prompts to keep the real-model suite within its
# time budget: each prompt gets one setting from each list, each setting six prompts
# spread over the datasets. Decoders live for the whole session, so drafters that keep
# memory across requests are checked with that memory in place. (`racer bench` over
# the same prompts checks every method on every prompt; see the README.)
# "racer" and the other tree methods without a capacity run capacity=auto: the
# verified tree is chosen by the draft budget, so its size changes every step.
RACER_SETTINGS = ["racer", "racer:capacity=16:memory=fresh", "racer:capacity=8",
                  "racer:capacity=64", "racer:memory=fresh", "racer:capacity=64:memory=fresh"]
OTHER_SETTINGS = ["token-recycling", "logitspec", "rest:datastore={datastore}", "pld:variant=hf",
                  "none", "token-recycling:prefill=true:memory=fresh"]
# Verification with one linear kernel at every tree size, whatever this machine's cost
# table chose (it picks the kernel per size by speed; every kernel must be lossless).
# The kernels are CPU fast paths: off the CPU every size runs the model's own layers.
FORCED_KERNEL_SETTINGS = ["packed racer:capacity=16", "weight_major racer", "packed token-recycling:capacity=8",
                          "weight_major racer:capacity=64", "hybrid racer:capacity=32"] if TEST_DEVICE == "cpu" else []


@pytest.fixture(scope="session")
def datastore(real, tmp_path_factory):
    """A REST datastore from text the project ships: its own code, tests and README."""
    from racer.drafting.datastore import build_datastore

    out = tmp_path_factory.mktemp("datastore") / "project"
    build_datastore([REPO / "src", REPO / "tests", REPO / "README.md"], real[1], out, pattern="*.py")
    return str(out)


@pytest.fixture(scope="session")
def decoders(real, datastore):
    model, tokenizer = real
    specs = EVERY_PROMPT + RACER_SETTINGS + OTHER_SETTINGS
    out = {spec: Decoder(model, tokenizer, spec.format(datastore=datastore)) for spec in specs}
    table = load_or_measure(model)
    for name in FORCED_KERNEL_SETTINGS:
        kernel, method = name.split()
        forced = replace(table, seconds=list(table.seconds), kernels=[kernel] * len(table.sizes), path=None)
        out[name] = Decoder(model, tokenizer, method, cost=forced)
        assert {out[name].verifier.kernel_of(n) for n in range(1, 65)} == {kernel}
    if FORCED_KERNEL_SETTINGS and packed_weights(model) is None:
        pytest.fail("no oneDNN-packed weights on this machine: the packed kernel would go unchecked")
    return out


def test_prompt_set_covers_every_category():
    spec = {q.category for q in QUESTIONS if q.dataset == "spec_bench"}
    assert len(spec) == 13 and len(QUESTIONS) == 26 + 5 + 5 + 1 + 1
    assert QUESTIONS[-1].dataset == "agent_sessions" and len(QUESTIONS[-1].chat) == 8


@pytest.mark.parametrize("settings", [RACER_SETTINGS, OTHER_SETTINGS, FORCED_KERNEL_SETTINGS])
def test_every_rotating_setting_gets_prompts_from_several_datasets(settings):
    for i, setting in enumerate(settings):
        assert len({q.dataset for q in QUESTIONS[i :: len(settings)]}) >= 2, setting


@pytest.mark.parametrize("index", range(len(QUESTIONS)), ids=[q.key for q in QUESTIONS])
def test_every_method_matches_hf_greedy(real, decoders, index):
    model, tokenizer = real
    question = QUESTIONS[index]
    ids = encode_prompt(tokenizer, question.chat, chat=True)
    reference = hf_greedy(model, ids, LOSSLESS_NEW_TOKENS)
    mismatched = {}
    methods = EVERY_PROMPT + [settings[index % len(settings)]
                              for settings in (RACER_SETTINGS, OTHER_SETTINGS, FORCED_KERNEL_SETTINGS) if settings]
    for method in methods:
        result = decoders[method].generate(ids, max_new_tokens=LOSSLESS_NEW_TOKENS)
        if result.tokens != reference:
            first = next((i for i, (a, b) in enumerate(zip(result.tokens, reference)) if a != b),
                         min(len(result.tokens), len(reference)))
            mismatched[method] = f"first difference at token {first} of {len(reference)}"
    assert not mismatched, mismatched
