"""Shared fixtures: the real embedded model (loaded once per test process), a tiny
random Llama for fast structural tests, and the lossless prompt set.

Tests that use the real model (the ``real`` fixtures) are marked ``real``; ``make
test-fast`` runs the others. The whole suite keeps racer's cache (the converted model,
cost tables) in a folder of its own, never the user's ``~/.cache/racer``:
``$RACER_TEST_CACHE`` if set (kept), else a temporary folder removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a hub
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The controller (or a run without workers) picks the folder; workers inherit it.
_OWN_CACHE = None
if not os.environ.get("PYTEST_XDIST_WORKER"):
    if os.environ.get("RACER_TEST_CACHE"):
        os.environ["RACER_CACHE"] = os.path.abspath(os.environ["RACER_TEST_CACHE"])
    else:
        _OWN_CACHE = os.environ["RACER_CACHE"] = tempfile.mkdtemp(prefix="racer-test-cache-")

# The custom_generate folder's test loads it as transformers loads remote code: into a
# modules folder of the suite's own, not the user's.
if os.environ.get("RACER_CACHE"):
    os.environ.setdefault("HF_MODULES_CACHE", os.path.join(os.environ["RACER_CACHE"], "hf-modules"))

import pytest
import torch

from racer.bench.questions import Question, load_questions

REAL_FIXTURES = {"real", "real_bf16"}
# Where the real model and the family matrix run: "cpu" here and in CI; scripts/gpu-check
# sets "cuda" on a GPU machine.
TEST_DEVICE = os.environ.get("RACER_TEST_DEVICE", "cpu")


def _transformers_at_least(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


# Fast paths that older transformers do not offer (racer then runs without them).
needs_cache_layers = pytest.mark.skipif(not _transformers_at_least("4.56"),
                                        reason="the growing cache needs per-layer KV caches: transformers >= 4.56")
needs_attention_interface = pytest.mark.skipif(not _transformers_at_least("4.50"),
                                               reason="tree attention needs AttentionInterface: transformers >= 4.50")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.real)


def pytest_unconfigure(config):
    if _OWN_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per worker; two threads each would contend

LOSSLESS_NEW_TOKENS = 128


def lossless_questions() -> list[Question]:
    """At least 2 per Spec-Bench category, 5 of HumanEval and 5 of MGSM, a code-editing
    request and an agent session's last call (the longest prompt: the whole conversation)."""
    return (load_questions("spec_bench", limit=2) + load_questions("human_eval", limit=5)
            + load_questions("mgsm", limit=5) + load_questions("code_edit", limit=1)[:1]
            + load_questions("agent_sessions", limit=1)[-1:])


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer): the embedded SmolLM2-135M-Instruct in float32."""
    from racer import load_model

    return load_model(dtype="float32", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def real_bf16():
    from racer import load_model

    return load_model(dtype="bfloat16", device=TEST_DEVICE)


def make_tiny_llama(attn: str = "sdpa", seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="session", params=["sdpa", "eager"])
def tiny(request):
    return make_tiny_llama(request.param)


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: Hugging Face generate, greedy."""
    tensor = torch.tensor([ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                             max_new_tokens=max_new_tokens, num_beams=1, top_p=None, top_k=None,
                             temperature=None)
    return out[0, len(ids):].tolist()
