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
The packed kernel also computes sibling layers that read the same input (a layer's
query, key and value projections; an MLP's gate and up projections) as one product over
their weights packed side by side: fewer, larger products, and one layer call does the
work of three. The first sibling called computes every sibling's output and keeps the
others' for their own calls on that same input. Where this machine's oneDNN does not give
the side-by-side product bit for bit what the separate ones give, siblings stay apart.
A fused sibling's weight is packed side by side only, never also on its own: the packed
weights take the model's weights' memory once over, not one and a half times.

Modules that already carry an instance ``forward`` (accelerate's hooks), subclasses
(quantised layers) and weights of other dtypes than their inputs keep the model's
own path. A model shared between threads must not run another forward pass while a
tree pass holds it.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from racer.fastpaths import KERNELS

_NEEDS_PACKED = ("packed", "hybrid")

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_linear = torch.nn.functional.linear

# (the weight, its version counter when packed, the packed copy)
PackedWeight = tuple[torch.Tensor, int, torch.Tensor]


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


Forward = Callable[[torch.Tensor], torch.Tensor]

# Sibling layers that a block calls on one input, in the attribute names most families use.
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Rows of the products that check a side-by-side product against the separate ones.
_PROBE_ROWS = (1, 7, 64, 300)


class Siblings:
    """Layers of one block called on the same input, computed as one product over their
    packed, concatenated weights: ``forward_of(i)`` is the i-th layer's forward. The
    others' outputs are kept, until their own calls, only for the input they came from
    (the same tensor, unchanged since where torch counts its changes)."""

    def __init__(self, layers: tuple[torch.nn.Linear, ...], packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.layers = layers
        self.packed = packed
        self.bias = bias
        self.versions = [layer.weight._version for layer in layers]
        self.weights = [layer.weight for layer in layers]
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.clear()

    def clear(self) -> None:
        self.input: torch.Tensor | None = None
        self.input_version = -1
        self.kept: list[torch.Tensor | None] = [None] * len(self.layers)

    def current(self) -> bool:
        """Whether every layer still has the weight that was packed, unchanged."""
        return all(layer.weight is weight and weight._version == version
                   for layer, weight, version in zip(self.layers, self.weights, self.versions))

    def forward_of(self, index: int) -> Forward:
        layer = self.layers[index]
        pointwise = torch.ops.mkldnn._linear_pointwise

        def forward(x: torch.Tensor) -> torch.Tensor:
            kept = self.kept[index]
            if kept is not None and self.input is x and self.input_version == _version(x):
                self.kept[index] = None
                return kept
            if x.dtype != layer.weight.dtype or not self.current():
                return _linear(x, layer.weight, layer.bias)
            both = pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], "")
            outputs = [both[:, start:end].view(*x.shape[:-1], end - start) for start, end in self.bounds]
            self.input, self.input_version = x, _version(x)
            self.kept = [None if i == index else out for i, out in enumerate(outputs)]
            return outputs[index]

        return forward


def _version(x: torch.Tensor) -> int:
    """``x``'s version counter; 0 for an inference tensor, which counts none (a block
    does not change its input in place between its siblings' calls)."""
    return 0 if x.is_inference() else x._version


def sibling_groups(model: Any) -> list[tuple[torch.nn.Linear, ...]]:
    """Groups of plain linear layers (``_SIBLINGS``) of one block that read inputs of one
    width, with biases on all or none."""
    plain = {id(m) for m in _plain_layers(model)}
    groups = []
    for module in model.modules():
        for names in _SIBLINGS:
            layers = tuple(getattr(module, name, None) for name in names)
            if not all(isinstance(layer, torch.nn.Linear) and id(layer) in plain for layer in layers):
                continue
            first = layers[0]
            if all(layer.in_features == first.in_features and layer.weight.dtype == first.weight.dtype
                   and layer.weight.device == first.weight.device and (layer.bias is None) == (first.bias is None)
                   for layer in layers):
                groups.append(layers)
    return groups


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=16)


def _side_by_side_exact(widths: tuple[int, ...], features: int) -> bool:
    """Whether oneDNN's product over weights packed side by side equals, bit for bit, the
    separate products, for random weights of these shapes."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(width, features, generator=generator) for width in widths]
    pointwise = torch.ops.mkldnn._linear_pointwise
    together = _pack(torch.cat(weights))
    apart = [_pack(w) for w in weights]
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, features, generator=generator)
        joined = pointwise(x, together, None, "none", [], "")
        if not torch.equal(joined, torch.cat([pointwise(x, w, None, "none", [], "") for w in apart], 1)):
            return False
    return True


@dataclass
class _Packing:
    """A model's packed weights: side by side for sibling groups, one copy each for the
    other layers' weights."""

    singles: dict[int, PackedWeight]
    siblings: list[Siblings]


_packings: "weakref.WeakKeyDictionary[Any, _Packing | None]" = weakref.WeakKeyDictionary()


def _packing_of(model: Any) -> _Packing | None:
    if model in _packings:
        return _packings[model]
    layers = _plain_layers(model)
    weights = {id(m.weight): m.weight for m in layers}
    fits = 2 * sum(w.numel() * w.element_size() for w in weights.values()) <= _available_memory()
    usable = (torch.backends.mkldnn.is_available() and fits and weights
              and all(w.device.type == "cpu" and w.dtype == torch.float32 for w in weights.values()))
    packing = None
    if usable:
        try:
            with torch.inference_mode():
                siblings = _side_by_side(model)
                fused = {id(layer) for group in siblings for layer in group.layers}
                singles = {id(m.weight): (m.weight, m.weight._version, _pack(m.weight))
                           for m in layers if id(m) not in fused}
            packing = _Packing(singles, siblings)
        except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
            pass
    _packings[model] = packing
    return packing


def _side_by_side(model: Any) -> list[Siblings]:
    """The sibling groups whose side-by-side product this machine computes bit for bit
    as the separate ones, with their weights packed side by side."""
    exact: dict[tuple, bool] = {}
    built = []
    for group in sibling_groups(model):
        shape = (tuple(layer.out_features for layer in group), group[0].in_features)
        if shape not in exact:
            exact[shape] = _side_by_side_exact(*shape)
        if exact[shape]:
            bias = torch.cat([layer.bias.detach() for layer in group]) if group[0].bias is not None else None
            built.append(Siblings(group, _pack(torch.cat([layer.weight.detach() for layer in group])), bias))
    return built


def packed_weights(model: Any) -> dict[int, PackedWeight] | None:
    """oneDNN-packed copies of the model's linear weights, built once per model, or None
    where they cannot be had: no oneDNN, not a float32 CPU model (16-bit oneDNN paths
    are not offered: their agreement with the model's layers is unchecked), or copies
    that would take more than half the memory still available (they double the
    weights' footprint). Layers computed as siblings (``packed_siblings``) have no copy
    of their own here: their group's side-by-side copy is their only one."""
    packing = _packing_of(model)
    return packing.singles if packing is not None else None


def packed_siblings(model: Any) -> list[Siblings]:
    """The model's sibling groups with their weights packed side by side, built once per
    model with ``packed_weights``; none where packed weights are refused, or where this
    machine's side-by-side products differ from the separate ones."""
    packing = _packing_of(model)
    return packing.siblings if packing is not None else []


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
        return _packings.get(self.model) is not None

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
            if kernel == "packed":
                for group in packed_siblings(self.model):
                    group.clear()
                    forwards += [(layer, group.forward_of(i)) for i, layer in enumerate(group.layers)]
            taken = {id(layer) for layer, _ in forwards}
            for layer in layers:
                if id(layer) in taken:
                    continue
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
            if kernel == "packed":
                for group in packed_siblings(self.model):
                    group.clear()  # no pass's activations held past it
