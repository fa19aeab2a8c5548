"""The model-family matrix (``tests/families.py``): every family decodes token-identically
to ``generate`` with every method, windowed ones on a prompt longer than the window and
after committing branching paths, or is refused with a clear error; none crashes."""

from __future__ import annotations

import pytest

from families import FAMILIES, LONG, METHODS, WINDOW, Family, build, known, run_family
from racer import Decoder, UnsupportedModelError


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.refused], ids=lambda f: f.label)
def test_family_decodes_identically_to_generate(family: Family):
    if not known(family):
        pytest.skip(f"{family.model_type} is not in this transformers")
    runs = run_family(family)
    assert len(runs) == 2 * len(METHODS)
    wrong = [(run.method, run.prompt) for run in runs if not run.identical]
    assert not wrong, f"{family.label}: differs from generate for {wrong}"
    racer = [run for run in runs if run.method == "racer:capacity=64"]
    assert sum(run.accepted for run in racer) > 0, "no draft was ever accepted: the matrix would test nothing"
    if family.windowed:
        assert LONG > WINDOW
        long = next(run for run in racer if run.prompt == "long")
        assert long.branching_commits > 0, "no branching path was committed past the window"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.refused], ids=lambda f: f.label)
def test_family_is_refused_with_its_reason(family: Family):
    if not known(family):
        pytest.skip(f"{family.model_type} is not in this transformers")
    model = build(family)
    with pytest.raises(UnsupportedModelError, match=family.refused):
        Decoder(model, None, "racer")
    # Even without the self-test, racer refuses up front rather than decode wrongly.
    with pytest.raises(UnsupportedModelError, match=family.refused):
        Decoder(model, None, "racer", check=False)


def test_matrix_covers_the_families_users_bring():
    types = {f.model_type for f in FAMILIES}
    assert len(types) >= 30
    named = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
             "gemma3_text", "gemma3n_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "gpt_neo", "opt", "falcon",
             "olmo", "olmo2", "olmo3", "granite", "stablelm", "starcoder2", "cohere", "cohere2", "deepseek_v2",
             "deepseek_v3", "smollm3", "glm", "glm4", "nemotron", "exaone4", "ministral", "gpt_oss", "llama4_text",
             "lfm2_moe", "qwen3_next", "qwen3_5_text", "nemotron_h", "olmo_hybrid", "mamba"}
    assert named <= types, sorted(named - types)
    windowed = {f.model_type for f in FAMILIES if f.windowed and not f.refused}
    assert {"mistral", "mixtral", "qwen2", "qwen3", "phi3", "starcoder2", "gemma2", "gemma3_text", "cohere2",
            "olmo3", "exaone4", "ministral", "gpt_oss", "llama4_text", "gpt_neo"} <= windowed


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.windowed and not f.refused], ids=lambda f: f.label)
def test_the_window_changes_what_generate_emits_on_the_long_prompt(family: Family):
    """Without this, a racer mask that ignored the window could still match."""
    from dataclasses import replace

    from families import greedy, prompts

    if not known(family):
        pytest.skip(f"{family.model_type} is not in this transformers")
    wide = {k: 4096 if k in ("sliding_window", "window_size", "attention_chunk_size") else v
            for k, v in family.overrides.items()}
    ids = prompts(128)["long"]
    assert greedy(build(family), ids) != greedy(build(replace(family, overrides=wide)), ids)
