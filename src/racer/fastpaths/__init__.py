"""Optional CPU fast paths of a tree pass: each switchable on its own, none changes an output.

Tree attention, the growing cache and the lean stack give logits bit-identical to the
model's own path;
a linear kernel sums in another order, so it is offered only where it agrees with the
model's own layers to the tolerance of tree verification; packed rows give a batched
pass's linear layers another shape, which may change their sums' last bits as batching
itself does. This file imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# "model": the model's own layers; "weight_major": ``(W @ x.T).T``; "packed": oneDNN
# from weights packed once; "hybrid": weight-major layers with a packed output layer
# (the output layer, vocabulary x hidden, is the largest single matrix by far).
KERNELS = ("model", "weight_major", "packed", "hybrid")
KERNEL_LABELS = {"model": "stock", "weight_major": "W@x.T", "packed": "packed", "hybrid": "hybrid"}


@dataclass(frozen=True)
class FastPaths:
    """``kernels``: per-size linear kernels chosen by the measured cost table
    (``fastpaths.kernels``); ``tree_attention``: grouped-query SDPA over the tree mask
    without repeating the cache's KV heads (``fastpaths.attention``); ``growing_cache``:
    KV appended in place instead of ``torch.cat`` (``fastpaths.kvcache``); ``packed_rows``:
    a batched pass lays its rows' trees one after another instead of padding each to the
    largest (``fastpaths.attention.PackedRows``; it needs tree attention); ``stack``: a
    Llama-pattern decoder stack runs as its layers' tensor operations without
    transformers' per-call scaffolding (``fastpaths.stack``)."""

    kernels: bool = True
    tree_attention: bool = True
    growing_cache: bool = True
    packed_rows: bool = True
    stack: bool = True

    @staticmethod
    def of(value: "bool | FastPaths") -> "FastPaths":
        """``True`` (all on), ``False`` (all off) or a ``FastPaths``."""
        if isinstance(value, FastPaths):
            return value
        if isinstance(value, bool):
            return FastPaths(value, value, value, value, value)
        raise ValueError(f"fast_paths: expected True, False or a FastPaths, got {value!r}")

    def on(self, device_type: str) -> "FastPaths":
        """The fast paths that apply on a ``device_type`` ("cpu", "cuda", ...): the
        linear kernels (oneDNN packing, weight-major products timed against the CPU's
        own) and tree attention (a CPU SDPA property), with the packed rows it serves,
        are CPU-only; so is the lean stack, whose probe has been run on CPUs only; the
        growing cache applies everywhere."""
        if device_type == "cpu":
            return self
        return FastPaths(kernels=False, tree_attention=False, growing_cache=self.growing_cache, packed_rows=False,
                         stack=False)

    def key(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["FastPaths", "KERNELS", "KERNEL_LABELS"]
