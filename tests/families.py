"""The model-family matrix: tiny random configurations of Hugging Face causal-LM
families, each decoded with racer's methods on a short prompt and on one longer than
its attention window, token by token against ``generate(do_sample=False)``.

``tests/test_families.py`` runs it; ``python tests/families.py --summary`` prints the
README's "Which models work" table from a fresh run, ``python tests/families.py`` the
full one of docs/models.md.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

WINDOW = 16  # every windowed tiny config's window (or chunk): the long prompt runs past it
SHORT, LONG, NEW_TOKENS = 6, 40, 32
DEVICE = os.environ.get("RACER_TEST_DEVICE", "cpu")  # scripts/gpu-check runs the matrix on "cuda"
METHODS = ("none", "pld", "racer:capacity=64", "racer:capacity=auto", "token-recycling")

_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=None, tie_word_embeddings=False)
_GPT2_SHAPE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)
_TWO_TYPES = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
            n_group=1, topk_group=1)
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


@dataclass(frozen=True)
class Family:
    """One tiny configuration: transformers ``model_type`` and overrides of the shared
    tiny shape; ``refused``: the reason racer is expected to give (a phrase of its
    ``UnsupportedModelError``), or None where it must decode identically."""

    label: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    refused: str | None = None
    window: str = "full"

    @property
    def windowed(self) -> bool:
        return self.window != "full"


FAMILIES = [
    Family("Llama", "llama"),
    Family("Mistral (no window)", "mistral", dict(sliding_window=None)),
    Family("Mistral (sliding window)", "mistral", dict(sliding_window=WINDOW), window="sliding"),
    Family("Mistral (window 4096 > context)", "mistral", dict(sliding_window=4096)),
    Family("Mixtral (sliding window)", "mixtral", dict(sliding_window=WINDOW, num_local_experts=4,
                                                       num_experts_per_tok=2), window="sliding"),
    Family("Qwen2 / Qwen2.5", "qwen2"),
    Family("Qwen2 (sliding window, upper layers)", "qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                                 max_window_layers=1), window="sliding + full"),
    Family("Qwen2-MoE", "qwen2_moe", dict(_MOE, shared_expert_intermediate_size=32)),
    Family("Qwen3", "qwen3"),
    Family("Qwen3 (sliding window)", "qwen3", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1), window="sliding + full"),
    Family("Qwen3-MoE", "qwen3_moe", _MOE),
    Family("Gemma", "gemma"),
    Family("Gemma 2", "gemma2", dict(sliding_window=WINDOW), window="sliding + full"),
    Family("Gemma 3", "gemma3_text", _TWO_TYPES, window="sliding + full"),
    Family("Gemma 3n (KV-shared layers)", "gemma3n_text", dict(
        sliding_window=WINDOW, num_hidden_layers=4, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128, intermediate_size=[128] * 4, activation_sparsity_pattern=[0.0] * 4,
        altup_num_inputs=2, laurel_rank=8), window="sliding + full"),
    Family("Phi", "phi", dict(partial_rotary_factor=0.5)),
    Family("Phi-3", "phi3", dict(sliding_window=None)),
    Family("Phi-3 (sliding window)", "phi3", dict(sliding_window=WINDOW), window="sliding"),
    Family("GPT-2", "gpt2", _GPT2_SHAPE),
    Family("GPT-BigCode", "gpt_bigcode", _GPT2_SHAPE),
    Family("GPT-NeoX", "gpt_neox", dict(rotary_pct=0.25)),
    Family("GPT-J", "gptj", dict(_GPT2_SHAPE, rotary_dim=8)),
    Family("GPT-Neo (global + local layers)", "gpt_neo", dict(attention_types=[[["global", "local"], 1]],
                                                                window_size=WINDOW, num_layers=2, num_heads=4),
           window="sliding + full"),
    Family("OPT", "opt", dict(ffn_dim=128, word_embed_proj_dim=64)),
    Family("Falcon (rotary)", "falcon", dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None)),
    Family("Falcon (ALiBi)", "falcon", dict(alibi=True, head_dim=None), refused="ALiBi", window="full, ALiBi"),
    Family("BLOOM", "bloom", dict(n_layer=2, n_head=4), refused="ALiBi", window="full, ALiBi"),
    Family("OLMo", "olmo"),
    Family("OLMo 2", "olmo2"),
    Family("OLMo 3", "olmo3", _TWO_TYPES, window="sliding + full"),
    Family("OLMoE", "olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    Family("Granite", "granite"),
    Family("Granite-MoE", "granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    Family("StableLM", "stablelm"),
    Family("StarCoder2", "starcoder2", dict(sliding_window=None)),
    Family("StarCoder2 (sliding window)", "starcoder2", dict(sliding_window=WINDOW), window="sliding"),
    Family("Cohere", "cohere"),
    Family("Cohere 2", "cohere2", _TWO_TYPES, window="sliding + full"),
    Family("DeepSeek-V2", "deepseek_v2", dict(_MLA, q_lora_rank=None)),
    Family("DeepSeek-V3", "deepseek_v3", dict(_MLA, q_lora_rank=16)),
    Family("SmolLM3", "smollm3"),
    Family("GLM", "glm"),
    Family("GLM-4", "glm4"),
    Family("Nemotron", "nemotron"),
    Family("Helium", "helium"),
    Family("EXAONE 4", "exaone4", _TWO_TYPES, window="sliding + full"),
    Family("Ministral", "ministral", _TWO_TYPES, window="sliding + full"),
    Family("gpt-oss (sinks)", "gpt_oss", dict(_TWO_TYPES, num_local_experts=4, num_experts_per_tok=2),
           window="sliding + full"),
    Family("Llama 4 (chunked)", "llama4_text", dict(attention_chunk_size=WINDOW, num_local_experts=2,
                                                    interleave_moe_layer_step=1, intermediate_size_mlp=128,
                                                    no_rope_layers=[1, 0]), window="chunked + full"),
    Family("LFM2-MoE (convolution layers)", "lfm2_moe", dict(_MOE, num_dense_layers=1,
                                                             layer_types=["conv", "full_attention"]),
           refused="convolution", window="convolution + full"),
    Family("Qwen3-Next (linear attention)", "qwen3_next", dict(_MOE, **_LINEAR), refused="linear-attention", window="linear + full"),
    Family("Qwen3.5 (linear attention)", "qwen3_5_text", _LINEAR, refused="linear-attention", window="linear + full"),
    Family("OLMo hybrid (linear attention)", "olmo_hybrid", _LINEAR, refused="linear-attention",
           window="linear + full"),
    Family("Nemotron-H (Mamba layers)", "nemotron_h", dict(layers_block_type=["linear_attention", "full_attention"],
                                                            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                                                            n_groups=1), refused="linear-attention",
           window="Mamba + full"),
    Family("Mamba (state space)", "mamba", dict(state_size=8), refused="state-space", window="state space"),
]


def known(family: Family) -> bool:
    """Whether the installed transformers has the family at all."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return family.model_type in CONFIG_MAPPING


def build(family: Family, seed: int = 0) -> Any:
    """The family's tiny model, randomly initialised in float32 (SDPA where the family
    offers it, else eager)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arguments = {k: v for k, v in {**_BASE, **family.overrides}.items()
                 if v is not None or k in ("sliding_window", "eos_token_id")}
    config = AutoConfig.for_model(family.model_type, **arguments)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, ImportError):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float().to(DEVICE).eval()


def prompts(vocab: int, seed: int = 1) -> dict[str, list[int]]:
    """A short prompt and one longer than every tiny window, both repeating a random
    phrase so that drafts get accepted and trees branch."""
    rng = np.random.default_rng(seed)
    phrase = [int(t) for t in rng.integers(3, vocab, size=8)]
    return {"short": (phrase * 10)[:SHORT], "long": (phrase * 10)[:LONG]}


def greedy(model: Any, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    tensor = torch.tensor([ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1, top_p=None,
                             top_k=None, temperature=None)
    return out[0, len(ids):].tolist()


def shared_cost() -> Any:
    """One made-up step-cost table for every tiny model: ``capacity=auto`` needs a curve,
    and what a tiny model's pass costs is not what the matrix tests."""
    from racer.budget.cost import SIZES, CostModel

    return CostModel(list(SIZES), [1e-3 * (1 + 0.02 * s) for s in SIZES], 32)


@dataclass
class Run:
    """One method on one prompt: whether it matched ``generate``, and how many steps
    committed a branching path (nodes off the first-child chain)."""

    method: str
    prompt: str
    identical: bool
    branching_commits: int
    accepted: int


def decode(model: Any, method: str, ids: list[int]) -> tuple[list[int], int, int]:
    """Greedy racer decoding of ``ids``: (tokens, branching commits, accepted draft tokens)."""
    from racer import Decoder

    decoder = Decoder(model, None, method, cost=shared_cost())
    branching = 0
    commit = decoder.verifier.commit

    def counting_commit(path: list[int], tree_size: int) -> None:
        nonlocal branching
        branching += list(path) != list(range(len(path)))
        commit(path, tree_size)

    decoder.verifier.commit = counting_commit
    result = decoder.generate(ids, max_new_tokens=NEW_TOKENS)
    return result.tokens, branching, sum(step.accepted for step in result.steps)


def run_family(family: Family) -> list[Run]:
    """Every method on both prompts (raises ``UnsupportedModelError`` if racer refuses)."""
    model = build(family)
    runs = []
    for name, ids in prompts(int(model.config.vocab_size)).items():
        want = greedy(model, ids)
        for method in METHODS:
            tokens, branching, accepted = decode(model, method, ids)
            runs.append(Run(method, name, tokens == want, branching, accepted))
    return runs


def outcome(family: Family) -> str:
    """What racer does with the family: "identical (N runs)", "refused: <why>" or
    "DIFFERS: <which runs>"."""
    from racer import UnsupportedModelError

    if not known(family):
        return "not in this transformers"
    try:
        runs = run_family(family)
    except UnsupportedModelError as err:
        return f"refused: {_short(str(err))}"
    if all(run.identical for run in runs):
        return f"identical ({len(runs)} runs)"
    return "DIFFERS: " + ", ".join(f"{run.method} on the {run.prompt} prompt" for run in runs if not run.identical)


def _short(reason: str) -> str:
    for phrase, said in (("ALiBi", "ALiBi position bias"),
                         ("convolution", "recurrent, convolution or linear-attention state"),
                         ("state-space", "state-space layers")):
        if phrase in reason:
            return said
    return reason.split(";")[0]


def main(argv: list[str]) -> None:
    """``python tests/families.py [--summary]``: the matrix as a table, one row per
    configuration, or (``--summary``) one row per outcome and kind of attention."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    results = [(family, outcome(family)) for family in FAMILIES]
    print(f"Tiny random configurations, float32 on {DEVICE}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}; methods {', '.join(METHODS)}; prompts of {SHORT} and {LONG} tokens "
          f"(windows of {WINDOW}), {NEW_TOKENS} new tokens, each compared with `generate(do_sample=False)`.\n")
    if "--summary" in argv:
        groups: dict[tuple[str, str], list[str]] = {}
        for family, said in sorted(results, key=lambda result: not result[1].startswith("identical")):
            key = (said.split(" (")[0] if said.startswith("identical") else said, family.window)
            groups.setdefault(key, []).append(family.label)
        print("| racer | attention | families |")
        print("|---|---|---|")
        for (said, window), labels in groups.items():
            print(f"| {said} | {window} | {', '.join(labels)} |")
    else:
        print("| family | `model_type` | attention | racer |")
        print("|---|---|---|---|")
        for family, said in results:
            print(f"| {family.label} | `{family.model_type}` | {family.window} | {said} |")
    print(f"\n({len(FAMILIES)} configurations in {time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
