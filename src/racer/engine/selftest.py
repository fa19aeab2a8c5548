"""Whether a model can verify trees losslessly: an up-front check of its configuration,
then a self-test of tree verification against sequential decoding."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np
import torch

from racer.drafting.tree import DraftTree, TreeBuilder
from racer.engine.verifier import TreeVerifier


class UnsupportedModelError(ValueError):
    """The model cannot verify a tree losslessly with a custom attention mask."""


# Families whose layers keep no per-token KV (state-space / recurrent) or that add
# position information the mask cannot express.
_RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma",
                    "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "xlstm"}
_ALIBI_TYPES = {"bloom", "mpt", "falcon"}  # falcon only when config.alibi


def _check_supported(model: Any) -> None:
    config = model.config
    kind = getattr(config, "model_type", "?")
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn.startswith("flash") or attn.startswith("flex") or "paged" in attn:
        raise UnsupportedModelError(
            f"attn_implementation={attn!r} cannot take a custom 4D tree mask; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if kind in _RECURRENT_TYPES:
        raise UnsupportedModelError(f"model type {kind!r} has recurrent/state-space layers; tree verification needs attention KV")
    if kind in _ALIBI_TYPES and (kind != "falcon" or getattr(config, "alibi", False)):
        raise UnsupportedModelError(f"model type {kind!r} uses ALiBi, whose bias the tree mask would misplace")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any("sliding" in str(t) or "chunked" in str(t) for t in layer_types)
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None) and not layer_types:
        sliding = True
    if sliding:
        raise UnsupportedModelError(f"model type {kind!r} uses sliding-window attention; its cache cannot be compacted losslessly")


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """Logit tolerance between batched-tree and sequential decoding, for logits of
    magnitude up to ``scale``. float32 agrees to ~1e-4 on the embedded model; 16-bit
    formats keep ~3 significant digits, so their bound is relative (measured: 0.81 on
    logits of ~30 in bfloat16), still far below what a wrong mask produces."""
    return 2e-3 if dtype == torch.float32 else 0.06 * max(scale, 1.0)


_checked: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def random_tree(rng: np.random.Generator, vocab: int, size: int, max_depth: int) -> DraftTree:
    """A random branching tree (for self-tests): each new node hangs under a random
    existing node of depth < max_depth."""
    builder = TreeBuilder(int(rng.integers(vocab)), size)
    while len(builder) < size:
        parent = int(rng.integers(len(builder)))
        if builder.depths[parent] < max_depth:
            builder.add_child(parent, int(rng.integers(vocab)))
    return builder.build()


def sequential_logits(model: Any, context: Sequence[int], tree: DraftTree) -> torch.Tensor:
    """Reference: each node's logits from plain decoding of context + its path."""
    verifier = TreeVerifier(model)
    rows = []
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        rows.append(verifier.prefill(list(context) + path)[-1])
    return torch.stack(rows)


def self_test(model: Any, seed: int = 0) -> float:
    """Check once per model that tree verification matches sequential decoding;
    returns the largest logit difference. Raises UnsupportedModelError otherwise."""
    _check_supported(model)
    if model in _checked:
        return 0.0
    rng = np.random.default_rng(seed)
    vocab = int(model.config.vocab_size)
    context = [int(t) for t in rng.integers(vocab, size=5)]
    tree = random_tree(rng, vocab, 7, 3)
    try:
        verifier = TreeVerifier(model)
        verifier.prefill(context)
        got = verifier.verify(tree).float()
        want = sequential_logits(model, context, tree).float()
    except Exception as err:  # an exotic modeling file: say what failed, not where
        raise UnsupportedModelError(
            f"{type(model).__name__}: tree verification failed its self-test ({type(err).__name__}: {err})"
        ) from err
    error = float((got - want).abs().max())
    limit = tolerance(verifier.dtype, float(want.abs().max()))
    if not error <= limit:
        raise UnsupportedModelError(
            f"{type(model).__name__}: tree-verified logits differ from sequential decoding by {error:.3g} "
            f"(> {limit}); this model's attention does not honour a custom 4D mask"
        )
    _checked[model] = True
    return error
