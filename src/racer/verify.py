"""Tree verification on a stock Hugging Face causal LM: one forward pass over a draft
tree with a 4D additive mask, then KV compaction of the accepted path.

The stock modeling code takes a prepared 4D mask as-is, so no model file is patched.
"""

from __future__ import annotations

import inspect
import os
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from racer.attention import TreeAttention, tree_attention
from racer.tree import DraftTree, TreeBuilder
from racer.kvcache import growing_cache


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


_LINEAR = torch._C._nn.linear
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _LinearMode(TorchFunctionMode):
    """Within its scope, hands every ``linear(x, W)`` on plain tensors of one dtype to
    ``_rows`` as a 2-D ``x``; where ``_rows`` returns None the call runs as usual."""

    def _rows(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (type(x) in _PLAIN and type(weight) in _PLAIN and x.dtype == weight.dtype
                    and (bias is None or type(bias) in _PLAIN)):
                out = self._rows(x.reshape(-1, x.shape[-1]), weight, bias)
                if out is not None:
                    return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


class WeightMajorLinear(_LinearMode):
    """Within its scope, computes ``linear(x, W)`` as ``(W @ x.T).T``: the same sums.
    For a few rows of ``x``, some CPU BLAS builds read the weights once per row of
    ``x @ W.T`` but once in all for ``W @ x.T`` (on this project's 2-core EPYC a 4-node
    pass of the embedded model costs about one 1-node pass this way, 1.7 the stock way:
    ``scripts/measure_engine.py kernels``).
    Quantised or subclassed weights pass through untouched. The cost model decides, by
    measurement, for which tree sizes it is used (see ``racer.cost.measure``)."""

    def _rows(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if weight.dim() != 2:
            return None
        out = torch.mm(weight, rows.t()).t().contiguous()
        if bias is not None:
            out += bias
        return out


# (the weight, its version counter when packed, the packed copy)
PackedWeight = tuple[torch.Tensor, int, torch.Tensor]
_packed: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class PackedLinear(_LinearMode):
    """Within its scope, computes ``linear(x, W)`` with oneDNN from a copy of ``W``
    packed once into the library's blocked layout (``packed_weights``): the same
    products, without re-packing the weights on every call. On this project's 2-core
    EPYC, passes of 6-64 nodes of the embedded model cost up to a quarter less than with
    the faster of the other two kernels (``scripts/measure_engine.py kernels``). Weights
    it holds no copy of pass through untouched."""

    def __init__(self, packed: dict[int, PackedWeight]) -> None:
        super().__init__()
        self.packed = packed

    def _rows(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        entry = self.packed.get(id(weight))
        # The version check: a weight changed in place since packing (fine-tuning, a
        # loaded adapter) runs the model's own layer, never its stale copy.
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            return None
        return torch.ops.mkldnn._linear_pointwise(rows, entry[2], bias, "none", [], "")


def _available_memory() -> int:
    """Bytes of memory available to new allocations without swapping (0 where the OS
    does not say): Linux's MemAvailable counts reclaimable page cache, free pages do not."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def packed_weights(model: Any) -> dict[int, PackedWeight] | None:
    """oneDNN-packed copies of the model's linear weights for ``PackedLinear``, built
    once per model, or None where they cannot be had: no oneDNN, not a float32 CPU
    model (16-bit oneDNN paths are unmeasured here), or a copy that would take more
    than half the memory still available (it doubles the weights' footprint)."""
    if model in _packed:
        return _packed[model] or None
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, torch.nn.Linear) and type(m.weight) in _PLAIN and m.weight.dim() == 2}
    fits = 2 * sum(w.numel() * w.element_size() for w in weights.values()) <= _available_memory()
    usable = (torch.backends.mkldnn.is_available() and fits and weights
              and all(w.device.type == "cpu" and w.dtype == torch.float32 for w in weights.values()))
    packed: dict[int, PackedWeight] = {}
    if usable:
        try:
            with torch.inference_mode():
                packed = {key: (w, w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size=16))
                          for key, w in weights.items()}
        except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
            packed = {}
    _packed[model] = packed
    return packed or None


KERNELS = ("model", "weight_major", "packed")
KERNEL_LABELS = {"model": "stock", "weight_major": "W@x.T", "packed": "packed"}  # for printed tables


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
        self._packed: dict[int, PackedWeight] | None = None
        # Grouped-query attention of branching trees without repeating the cache's KV
        # heads (None where it does not apply: see ``racer.attention``).
        self.tree_attention: TreeAttention | None = tree_attention(model)

    def set_kernels(self, kernel_of: Callable[[int], str], used: Iterable[str]) -> None:
        """Verify a tree of n nodes with kernel ``kernel_of(n)``; ``used`` names every
        kernel it can return, so that what they need (packed weights) is built now, not
        inside the first timed step. Where packed weights cannot be had, those sizes
        run the model's own layers."""
        used = set(used)
        if not used <= set(KERNELS):
            raise ValueError(f"kernels: expected names from {KERNELS}, got {sorted(used)}")
        self._packed = packed_weights(self.model) if "packed" in used else None
        self.kernel_of = kernel_of

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
        kernel = self.kernel_of(n)
        linear: Any = nullcontext()
        if kernel == "weight_major":
            linear = WeightMajorLinear()
        elif kernel == "packed" and self._packed:
            linear = PackedLinear(self._packed)
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
