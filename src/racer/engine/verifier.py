"""Tree verification on a stock Hugging Face causal LM: one forward pass over a draft
tree with 4D additive masks (one per layer type where layers differ in their window:
``racer.engine.windows``), then KV compaction of the accepted path.

The stock modeling code takes prepared 4D masks as-is, so no model file is patched.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Iterable, Sequence

import torch

from racer.drafting.tree import DraftTree
from racer.engine.model_facts import ModelFacts
from racer.engine.support import check_supported
from racer.engine.windows import AttentionLayout, indexed_windows
from racer.fastpaths import KERNELS, FastPaths
from racer.fastpaths.attention import TreeAttention, tree_attention
from racer.fastpaths.kernels import LinearKernels
from racer.fastpaths.kvcache import growing_cache
from racer.fastpaths.stack import DecoderStack, decoder_stack


def _model_kernel(size: int) -> str:
    return "model"


class TreeVerifier:
    """Holds one request's KV cache. Invariant between steps: the cache holds every
    context token except the last emitted one, which is the next tree's root."""

    def __init__(self, model: Any, fast_paths: FastPaths = FastPaths(), facts: ModelFacts | None = None,
                 layout: AttentionLayout | None = None) -> None:
        """``facts`` and ``layout`` (``check_supported``'s): worked out from the model
        where not given; a decoder that makes a verifier per request hands its own."""
        self.model = model
        self.facts = facts or ModelFacts.of(model)
        self.device, self.dtype = self.facts.device, self.facts.dtype
        self.fast_paths = fast_paths.on(self.device.type)
        self._cache_kw = self.facts.cache_keyword
        self._keep_kw = self.facts.logits_keyword
        self.max_positions = self.facts.max_positions
        self.layout: AttentionLayout = layout if layout is not None else check_supported(model)
        self.cache: Any = None
        self.cached = 0
        # Which linear kernel (one of KERNELS) computes a pass of n positions (a tree or a
        # prompt chunk): chosen per width by the measured cost model (``set_kernels``).
        self.kernel_of: Callable[[int], str] = _model_kernel
        self.kernels = LinearKernels(model)
        # Grouped-query attention of branching trees without repeating the cache's KV
        # heads (None where it does not apply: see ``racer.fastpaths.attention``).
        self.tree_attention: TreeAttention | None = (tree_attention(model, self.device.type)
                                                     if self.fast_paths.tree_attention else None)
        # The decoder stack without transformers' per-call scaffolding, where the model
        # has the Llama layout and a probe agrees to the bit (``racer.fastpaths.stack``).
        self.stack: DecoderStack | None = None
        if self.fast_paths.stack:
            growing = self.fast_paths.growing_cache
            self.stack = decoder_stack(model, self.facts, lambda: self.empty_cache(model, growing))

    def set_kernels(self, kernel_of: Callable[[int], str], used: Iterable[str]) -> None:
        """Compute a pass of n positions (a tree of n nodes, a prompt chunk of n tokens)
        with kernel ``kernel_of(n)``; ``used`` names every kernel it can return, so that
        what they need (packed weights) is built now, not inside the first timed step. Where a kernel cannot run here (no packed weights),
        its sizes run the model's own layers, and so does every size with the kernels
        fast path off."""
        used = set(used)
        if not used <= set(KERNELS):
            raise ValueError(f"kernels: expected names from {KERNELS}, got {sorted(used)}")
        runnable = {k for k in used if self.fast_paths.kernels and self.kernels.available(k)}
        for kernel in runnable:
            self.kernels.prepare(kernel)

        def runnable_kernel(n: int) -> str:
            kernel = kernel_of(n)
            return kernel if kernel in runnable else "model"

        self.kernel_of = runnable_kernel

    def use_kernel(self, kernel: str) -> None:
        """Compute passes of every width, trees and prompts, with ``kernel``."""
        self.set_kernels(lambda n: kernel, [kernel])

    # -- forward passes -------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: Any, keep: int, *, cache: Any = None,
                batched: bool = False) -> torch.Tensor:
        """One pass of the model on ``cache`` (default: this verifier's): logits of the
        last ``keep`` positions (all where 0), (keep, vocab), or (rows, keep, vocab) when
        ``batched``."""
        kwargs: dict[str, Any] = {self._cache_kw: self.cache if cache is None else cache, "use_cache": True,
                                  "position_ids": positions, "attention_mask": mask}
        if self._keep_kw is not None and keep:
            kwargs[self._keep_kw] = keep
        with torch.inference_mode(), self.stack.installed() if self.stack is not None else nullcontext():
            out = self.model(input_ids=ids, **kwargs)
        logits = out.logits if batched else out.logits[0]
        return logits[..., -keep:, :] if keep else logits

    @staticmethod
    def empty_cache(model: Any, growing: bool = True) -> Any:
        """A new request's KV cache (``racer.fastpaths.kvcache.growing_cache``)."""
        return growing_cache(model.config, growing)

    def prefill(self, ids: Sequence[int], keep: int = 1) -> torch.Tensor:
        """Start a request: cache ``ids`` and return the logits at the last ``keep``
        positions (0: every position), shape (keep or L, vocab)."""
        self.cache = self.empty_cache(self.model, self.fast_paths.growing_cache)
        self.cached = 0
        n = len(ids)
        tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        with self.kernels.using(self.kernel_of(n)):
            logits = self.forward(tensor, positions, None, keep if 0 < keep < n else 0)
        self.cached = n
        return logits

    def resume(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Start a request whose first ``length`` positions' keys and values are known
        (per attention layer, (heads, positions, dim), as ``SlotCache.row_kv`` copies
        them): the cache holds them, and ``verify`` goes on from there."""
        self.cache = self.empty_cache(self.model, self.fast_paths.growing_cache)
        layers = getattr(self.cache, "layers", None)
        if layers is None or len(layers) != len(kv):
            raise RuntimeError("resume: the kept KV does not have this model's cache layers")
        with torch.inference_mode():
            for layer, (keys, values) in zip(layers, kv):
                layer.update(keys[None, :, :length], values[None, :, :length])
        self.cached = length

    def tree_mask(self, tree: DraftTree) -> Any:
        """The model's ``attention_mask`` for ``tree``: a (1, 1, N, cached + N) additive
        mask, 0 where a node may attend (the cache within its layer's window, its
        ancestors, itself), or one such mask per layer type."""
        depths = torch.tensor(tree.depths, dtype=torch.long, device=self.device)
        ancestors = torch.from_numpy(tree.ancestor_mask()).to(self.device)
        return self.layout.masks(self.cached, depths, ancestors, self.dtype, max(tree.depths))

    def verify(self, tree: DraftTree, keep: int = 0) -> torch.Tensor:
        """Logits at every tree node, shape (N, vocab), or at its last ``keep`` nodes.
        The tree's KV is appended to the cache until ``commit``."""
        n = len(tree)
        if self.cached + max(tree.depths) >= self.max_positions:
            raise ValueError("tree would run past the model's context window")
        ids = torch.tensor([tree.tokens], dtype=torch.long, device=self.device)
        positions = (torch.tensor(tree.depths, dtype=torch.long, device=self.device) + self.cached).unsqueeze(0)
        # A chain needs nothing but the model's own causal mask, but for more than one
        # new token that mask sends grouped-query layers down the path that repeats the
        # cache's KV heads, which tree attention avoids. Windowed models always get
        # racer's masks: the self-test checks those, not each family's own.
        if tree.is_chain and (n == 1 or self.tree_attention is None) and not self.layout.windowed:
            mask = None
        else:
            mask = self.tree_mask(tree)
        linear = self.kernels.using(self.kernel_of(n))
        attention = self.tree_attention if mask is not None and self.tree_attention is not None else nullcontext()
        with linear, attention, indexed_windows(self.layout, mask) as model_mask:
            return self.forward(ids, positions, model_mask, keep if 0 < keep < n else n)

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Layers that hold no KV of their own (shared-KV or attention-free) have None.
        if hasattr(self.cache, "layers"):
            pairs = [(layer.keys, layer.values) for layer in self.cache.layers]
        else:
            pairs = list(zip(self.cache.key_cache, self.cache.value_cache))
        return [(k, v) for k, v in pairs if k is not None and k.dim() == 4]

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

