"""Linear kernels for tree passes: the same products as the model's own layers, computed
in ways that read the weights fewer times for a few rows.

On a CPU a tree pass is bound by reading the weights. How often a BLAS reads them
depends on the number of rows: ``x @ W.T`` for a few rows can cost up to several
one-row products, while ``W @ x.T`` and oneDNN's pre-packed weights can read the
weights about once for several rows (``racer measure kernels`` times them). Which kernel is fastest for which tree size is measured per machine by the cost
model (``racer.engine.calibration.measure``); this module only computes.

A kernel is installed for one pass by giving each plain ``nn.Linear`` module an
instance ``forward`` and taking it away afterwards, rather than intercepting ``linear``
with a ``TorchFunctionMode``, which would send every torch call of the pass through
Python.
Modules that already carry an instance ``forward`` (accelerate's hooks), subclasses
(quantised layers) and weights of other dtypes than their inputs keep the model's
own path. A model shared between threads must not run another forward pass while a
tree pass holds it.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from racer.fastpaths import KERNELS

_NEEDS_PACKED = ("packed", "hybrid")

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_linear = torch.nn.functional.linear

# (the weight, its version counter when packed, the packed copy)
PackedWeight = tuple[torch.Tensor, int, torch.Tensor]
_packed: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


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


def _plain_layers(model: Any) -> list[torch.nn.Linear]:
    """The layers a kernel may take over: exactly ``nn.Linear`` (not a quantised
    subclass), plain 2-D weights, no instance ``forward`` of someone else's."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and type(m.weight) in _PLAIN
            and m.weight.dim() == 2 and "forward" not in m.__dict__]


def packed_weights(model: Any) -> dict[int, PackedWeight] | None:
    """oneDNN-packed copies of the model's linear weights, built once per model, or None
    where they cannot be had: no oneDNN, not a float32 CPU model (16-bit oneDNN paths
    are not offered: their agreement with the model's layers is unchecked), or a copy
    that would take more than half the memory still available (it doubles the weights'
    footprint)."""
    if model in _packed:
        return _packed[model] or None
    weights = {id(m.weight): m.weight for m in _plain_layers(model)}
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


Forward = Callable[[torch.Tensor], torch.Tensor]


def weight_major_forward(layer: torch.nn.Linear) -> Forward:
    """``layer``'s forward computed as ``(W @ x.T).T``: the same sums, the weight on the left."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        if x.dtype != weight.dtype:
            return _linear(x, weight, bias)
        out = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


def packed_forward(layer: torch.nn.Linear, entry: PackedWeight) -> Forward:
    """``layer``'s forward computed by oneDNN from the packed copy in ``entry``."""
    pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        # A weight replaced or changed in place since packing (fine-tuning, a loaded
        # adapter) runs the model's own layer, never its stale copy.
        if entry[0] is not weight or entry[1] != weight._version or x.dtype != weight.dtype:
            return _linear(x, weight, bias)
        out = pointwise(x.reshape(-1, x.shape[-1]), entry[2], bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


class LinearKernels:
    """Installs one of ``KERNELS`` in a model's plain linear layers for the span of a
    ``using`` block."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._forwards: dict[str, list[tuple[torch.nn.Linear, Forward]]] = {}

    def available(self, kernel: str) -> bool:
        """Whether ``kernel`` can run here (the packed ones need oneDNN-packed weights)."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
        return kernel not in _NEEDS_PACKED or packed_weights(self.model) is not None

    def ready(self, kernel: str) -> bool:
        """Whether ``kernel`` can run now without building anything (packed weights
        already built for this model, or none needed)."""
        if kernel not in _NEEDS_PACKED:
            return kernel in KERNELS
        return bool(_packed.get(self.model))

    def prepare(self, kernel: str) -> None:
        """Build what ``kernel`` needs (packed weights, the layers' forwards) now, not
        inside the first timed pass."""
        self._layer_forwards(kernel)

    def _layer_forwards(self, kernel: str) -> list[tuple[torch.nn.Linear, Forward]]:
        if kernel not in self._forwards:
            layers = _plain_layers(self.model) if kernel != "model" else []
            packed = packed_weights(self.model) if kernel in _NEEDS_PACKED else None
            head = getattr(self.model, "get_output_embeddings", lambda: None)()
            forwards = []
            for layer in layers:
                entry = packed.get(id(layer.weight)) if packed else None
                wants_packed = kernel == "packed" or (kernel == "hybrid" and layer is head)
                if wants_packed and entry is not None:
                    forwards.append((layer, packed_forward(layer, entry)))
                elif kernel in ("weight_major", "hybrid"):
                    forwards.append((layer, weight_major_forward(layer)))
            self._forwards[kernel] = forwards
        return self._forwards[kernel]

    @contextmanager
    def using(self, kernel: str) -> Iterator[None]:
        forwards = self._layer_forwards(kernel)
        try:
            for layer, forward in forwards:
                layer.__dict__["forward"] = forward  # past nn.Module.__setattr__: a plain attribute
            yield
        finally:
            for layer, _ in forwards:
                layer.__dict__.pop("forward", None)
