"""The KV cache of tree verification: every attention layer keeps every position
(windowed layers too: ``racer.engine.windows`` masks their windows), and appends in place.

Hugging Face's ``DynamicLayer`` appends a pass's keys and values with ``torch.cat``,
which copies the whole cache of every layer on every pass, a cost that grows with the
context (``python -m racer.bench.measure append`` times it). ``GrowingLayer`` keeps
each layer's keys and values in buffers that double when full and hands the attention
views of the filled part, so a pass writes only its own rows; cropping a rejected tree
just shortens the views. The values attended to are the same tensors' values, so
the logits are the same.
"""

from __future__ import annotations

from typing import Any

import torch

_MIN_CAPACITY = 256  # positions allocated at first, so that short requests never grow


def _growing_layer_class() -> Any:
    """``GrowingLayer``, defined against this transformers' ``DynamicLayer`` (None where
    the cache has no per-layer classes: transformers < 4.56)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys``/``values`` are views of the first
        ``length`` positions of buffers that grow by doubling."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.length = 0
            self._keys = self._values = None
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.is_initialized = True

        def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
            capacity = max(2 * needed, _MIN_CAPACITY)
            keys = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
            if self.length:
                keys[..., : self.length, :] = self._keys[..., : self.length, :]
                values[..., : self.length, :] = self._values[..., : self.length, :]
            self._keys, self._values = keys, values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self._keys is None or end > self._keys.shape[-2]:
                self._grow(key_states, value_states, end)
            self._keys[..., self.length : end, :] = key_states
            self._values[..., self.length : end, :] = value_states
            self._set_length(end)
            return self.keys, self.values

        def _set_length(self, length: int) -> None:
            self.length = length
            self.keys = self._keys[..., :length, :]
            self.values = self._values[..., :length, :]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop: expected how many tokens to remove as a negative number, "
                                 f"got {tokens_to_remove}")
            if tokens_to_remove == 0 or not self.is_initialized or self._keys is None:
                return
            self._set_length(max(self.length + tokens_to_remove, 0))

        def reset(self) -> None:
            self.keys = self.values = self._keys = self._values = None
            self.length = 0
            self.is_initialized = False

    return GrowingLayer


GrowingLayer = _growing_layer_class()


def growing_cache(config: Any, growing: bool = True) -> Any:
    """A ``DynamicCache`` for ``config`` in which every attention layer keeps every
    position: sliding-window and chunked layers too, because racer masks their windows
    itself and compacts all layers alike (``racer.engine.windows``). Full layers append
    in place (unless not ``growing``); other layer kinds keep their own classes, and
    transformers without per-layer caches get a plain ``DynamicCache``."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if not layers:
        return cache
    from transformers.cache_utils import DynamicLayer

    full = GrowingLayer if growing and GrowingLayer is not None else DynamicLayer
    for index, layer in enumerate(layers):
        if holds_plain_kv(layer):
            layers[index] = full()
    return cache


def holds_plain_kv(layer: Any) -> bool:
    """Whether a cache layer is transformers' own full or sliding-window KV layer (not a
    linear-attention, indexed or other subclass with state of its own): what racer
    replaces by a layer that keeps every position."""
    from transformers.cache_utils import DynamicLayer

    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer
    except ImportError:
        DynamicSlidingWindowLayer = DynamicLayer
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
