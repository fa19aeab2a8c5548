"""Tree verification on a stock Hugging Face causal LM: one forward pass over a draft
tree with a 4D additive mask, then KV compaction of the accepted path.

The stock modeling code takes a prepared 4D mask as-is, so no model file is patched.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from racer.attention import TreeAttention, tree_attention
from racer.kernels import KERNELS, LinearKernels
from racer.kvcache import growing_cache
from racer.tree import DraftTree, TreeBuilder


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


def _model_kernel(size: int) -> str:
    return "model"


class TreeVerifier:
    """Holds one request's KV cache. Invariant between steps: the cache holds every
    context token except the last emitted one, which is the next tree's root."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if "logits_to_keep" in params:
            self._keep_kw: str | None = "logits_to_keep"
        elif "num_logits_to_keep" in params:
            self._keep_kw = "num_logits_to_keep"
        else:
            self._keep_kw = None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.cache: Any = None
        self.cached = 0
        # Which linear kernel (one of KERNELS) verifies a tree of n nodes: chosen per size
        # by the measured cost model (``set_kernels``).
        self.kernel_of: Callable[[int], str] = _model_kernel
        self.kernels = LinearKernels(model)
        # Grouped-query attention of branching trees without repeating the cache's KV
        # heads (None where it does not apply: see ``racer.attention``).
        self.tree_attention: TreeAttention | None = tree_attention(model)

    def set_kernels(self, kernel_of: Callable[[int], str], used: Iterable[str]) -> None:
        """Verify a tree of n nodes with kernel ``kernel_of(n)``; ``used`` names every
        kernel it can return, so that what they need (packed weights) is built now, not
        inside the first timed step. Where a kernel cannot run here (no packed weights),
        its sizes run the model's own layers."""
        used = set(used)
        if not used <= set(KERNELS):
            raise ValueError(f"kernels: expected names from {KERNELS}, got {sorted(used)}")
        runnable = {k for k in used if self.kernels.available(k)}
        for kernel in runnable:
            self.kernels.prepare(kernel)

        def runnable_kernel(n: int) -> str:
            kernel = kernel_of(n)
            return kernel if kernel in runnable else "model"

        self.kernel_of = runnable_kernel

    def use_kernel(self, kernel: str) -> None:
        """Verify trees of every size with ``kernel``."""
        self.set_kernels(lambda n: kernel, [kernel])

    # -- forward passes -------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 keep: int) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: self.cache, "use_cache": True,
                                  "position_ids": positions, "attention_mask": mask}
        if self._keep_kw is not None and keep:
            kwargs[self._keep_kw] = keep
        with torch.inference_mode():
            out = self.model(input_ids=ids, **kwargs)
        logits = out.logits[0]
        return logits[-keep:] if keep else logits

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Start a request: cache ``ids`` and return the logits at the last position
        (or at every position when ``all_logits``), shape (L or 1, vocab)."""
        self.cache = growing_cache(self.model.config)
        self.cached = 0
        n = len(ids)
        tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        logits = self._forward(tensor, positions, None, 0 if all_logits else 1)
        self.cached = n
        return logits

    def tree_mask(self, tree: DraftTree) -> torch.Tensor:
        """(1, 1, N, cached + N) additive mask: 0 on the cache, ancestors and self."""
        n = len(tree)
        mask = torch.zeros((1, 1, n, self.cached + n), dtype=self.dtype, device=self.device)
        blocked = torch.from_numpy(~tree.ancestor_mask()).to(self.device)
        mask[0, 0, :, self.cached :].masked_fill_(blocked, torch.finfo(self.dtype).min)
        return mask

    def verify(self, tree: DraftTree) -> torch.Tensor:
        """Logits at every tree node, shape (N, vocab). The tree's KV is appended to
        the cache until ``commit``."""
        n = len(tree)
        if self.cached + max(tree.depths) >= self.max_positions:
            raise ValueError("tree would run past the model's context window")
        ids = torch.tensor([tree.tokens], dtype=torch.long, device=self.device)
        positions = (torch.tensor(tree.depths, dtype=torch.long, device=self.device) + self.cached).unsqueeze(0)
        # A chain needs nothing but the model's own causal mask, but for more than one
        # new token that mask sends grouped-query layers down the path that repeats the
        # cache's KV heads, which tree attention avoids.
        if tree.is_chain and (n == 1 or self.tree_attention is None):
            mask = None
        else:
            mask = self.tree_mask(tree)
        linear = self.kernels.using(self.kernel_of(n))
        attention = self.tree_attention if mask is not None and self.tree_attention is not None else nullcontext()
        with linear, attention:
            return self._forward(ids, positions, mask, n)

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if hasattr(self.cache, "layers"):
            return [(layer.keys, layer.values) for layer in self.cache.layers]
        return list(zip(self.cache.key_cache, self.cache.value_cache))

    def commit(self, path: Sequence[int], tree_size: int) -> None:
        """Keep the KV of ``path`` (node indices, root first) right after the cached
        context and drop the rest of the tree. Keys are stored after RoPE, and an
        accepted node's depth equals its new slot, so nothing is re-rotated."""
        kept = len(path)
        with torch.inference_mode():  # the cache tensors are inference tensors
            self._compact(path, kept, tree_size)
        self.cached += kept

    def _compact(self, path: Sequence[int], kept: int, tree_size: int) -> None:
        if list(path) != list(range(kept)):
            src = torch.tensor(path, dtype=torch.long, device=self.device) + self.cached
            dst = slice(self.cached, self.cached + kept)
            for keys, values in self._layers():
                keys[:, :, dst] = keys[:, :, src]
                values[:, :, dst] = values[:, :, src]
        if tree_size > kept:
            self.cache.crop(-(tree_size - kept))


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
