"""The KV cache of batched tree verification: one row ("slot") per request in flight.

Every attention layer keeps its keys and values in buffers of shape (slots, heads,
positions, head_dim). Active requests occupy rows 0..B-1, so a pass over them attends
to a view of the buffers, never a gathered copy; a request that ends hands its row to
the last active one (one copy of that row). Each row has its own length: a pass writes
row b's nodes at positions ``length[b]..``, attends over the longest row's span (what
lies past a row's own nodes is masked out), and compaction moves each row's accepted
nodes right after its own context. Windowed layers keep every position, as in the
single-request cache, so a window is only a mask.
"""

from __future__ import annotations

from typing import Any

import torch

from racer.fastpaths.kvcache import holds_plain_kv

_MIN_POSITIONS = 256


class SlotState:
    """What every layer of one slot cache shares: each active row's length (host ints)
    and, during a pass, where each row writes and how far the pass attends."""

    def __init__(self, rows: int = 1) -> None:
        self.max_rows = rows  # rows grow by doubling up to this (row by row would copy every layer each time)
        self.lengths: list[int] = []
        self.offsets: torch.Tensor | None = None  # (B,) write positions of the pass
        self.span = 0  # positions attended in the pass: the longest row + the pass's nodes
        # A packed pass (one sequence of every row's nodes): the row and the position
        # each of its tokens writes to; None in a padded pass.
        self.packed_rows: torch.Tensor | None = None
        self.packed_at: torch.Tensor | None = None


def _slot_layer_class() -> Any:
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers < 4.56: no per-layer caches to replace
        return None

    class SlotLayer(DynamicLayer):
        """One attention layer's slot buffers (``SlotState`` holds the rows' lengths)."""

        def __init__(self, state: SlotState) -> None:
            super().__init__()
            self.state = state
            self._keys: torch.Tensor | None = None
            self._values: torch.Tensor | None = None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int, positions: int) -> None:
            have_rows = 0 if self._keys is None else self._keys.shape[0]
            have_positions = 0 if self._keys is None else self._keys.shape[2]
            if rows <= have_rows and positions <= have_positions:
                return
            new_rows, new_positions = max(rows, have_rows), max(positions, have_positions)
            if rows > have_rows:
                new_rows = max(have_rows, 1)
                while new_rows < rows:
                    new_rows *= 2
                new_rows = max(rows, min(new_rows, self.state.max_rows))
            if positions > have_positions:
                new_positions = max(2 * positions, _MIN_POSITIONS)
            keys = like_k.new_zeros(new_rows, like_k.shape[1], new_positions, like_k.shape[3])
            values = like_v.new_zeros(new_rows, like_v.shape[1], new_positions, like_v.shape[3])
            if self._keys is not None:
                keys[:have_rows, :, :have_positions] = self._keys
                values[:have_rows, :, :have_positions] = self._values
            self._keys, self._values = keys, values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            state = self.state
            if state.packed_rows is not None:
                rows = len(state.lengths)
                self._reserve(key_states, value_states, rows, state.span)
                self._keys.transpose(1, 2)[state.packed_rows, state.packed_at] = key_states[0].transpose(0, 1)
                self._values.transpose(1, 2)[state.packed_rows, state.packed_at] = value_states[0].transpose(0, 1)
                self.keys = self._keys[:rows, :, : state.span]
                self.values = self._values[:rows, :, : state.span]
                return self.keys, self.values
            rows, _, nodes, _ = key_states.shape
            self._reserve(key_states, value_states, rows, state.span)
            where = state.offsets[:, None] + torch.arange(nodes, device=key_states.device)
            row = torch.arange(rows, device=key_states.device)[:, None].expand(rows, nodes)
            self._keys.transpose(1, 2)[row, where] = key_states.transpose(1, 2)
            self._values.transpose(1, 2)[row, where] = value_states.transpose(1, 2)
            self.keys = self._keys[:rows, :, : state.span]
            self.values = self._values[:rows, :, : state.span]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return max(self.state.lengths, default=0)

        def admit(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            length = keys.shape[-2]
            self._reserve(keys, values, row + 1, length)
            self._keys[row, :, :length] = keys[0]
            self._values[row, :, :length] = values[0]

        def move(self, source: int, target: int, length: int) -> None:
            self._keys[target, :, :length] = self._keys[source, :, :length]
            self._values[target, :, :length] = self._values[source, :, :length]

        def compact(self, row: int, source: torch.Tensor, start: int) -> None:
            kept = source.shape[0]
            self._keys[row, :, start : start + kept] = self._keys[row, :, source]
            self._values[row, :, start : start + kept] = self._values[row, :, source]

    return SlotLayer


SlotLayer = _slot_layer_class()


class SlotCache:
    """A ``DynamicCache`` for ``config`` whose attention layers are ``SlotLayer``s, with
    the operations of a batch: ``admit`` a prefilled request into a new row, ``release``
    a row, ``compact`` a row's accepted path."""

    def __init__(self, config: Any, rows: int = 1) -> None:
        """``rows``: the most requests it will hold (its rows grow by doubling up to it)."""
        from transformers import DynamicCache

        if SlotLayer is None:
            raise RuntimeError("batched decoding needs per-layer KV caches: transformers >= 4.56")
        self.state = SlotState(rows)
        self.cache = DynamicCache(config=config)
        for index, layer in enumerate(self.cache.layers):
            if holds_plain_kv(layer):
                self.cache.layers[index] = SlotLayer(self.state)
        self.slot_layers = [layer for layer in self.cache.layers if isinstance(layer, SlotLayer)]

    @property
    def rows(self) -> int:
        return len(self.state.lengths)

    def admit(self, single: Any, length: int) -> int:
        """Copy the first ``length`` positions of a one-request cache (as
        ``TreeVerifier`` leaves it) into a new last row; returns the row."""
        sources = [layer for layer in single.layers if layer.keys is not None and layer.keys.dim() == 4]
        if len(sources) != len(self.slot_layers):
            raise RuntimeError("admit: the request's cache has other layers than the batch's")
        return self.admit_kv([(layer.keys[0], layer.values[0]) for layer in sources], length)

    def admit_kv(self, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> int:
        """A new last row holding the first ``length`` positions of ``kv`` (per slot
        layer: keys and values (heads, positions, dim), as ``row_kv`` copies them; with
        ``length`` 0, an empty row that its first pass fills); returns the row."""
        row = self.rows
        if length and len(kv) != len(self.slot_layers):
            raise RuntimeError("admit: the kept KV has other layers than the batch's")
        if length:
            with torch.inference_mode():
                for target, (keys, values) in zip(self.slot_layers, kv):
                    keys, values = keys[None, :, :length], values[None, :, :length]
                    if not target.is_initialized:
                        target.lazy_initialization(keys, values)
                    target.admit(row, keys, values)
        self.state.lengths.append(length)
        return row

    def release(self, row: int) -> int | None:
        """Free ``row``; the last row moves into it. Returns the row that moved (now
        at ``row``), or None if ``row`` was the last."""
        last = self.rows - 1
        moved = None
        if row != last:
            with torch.inference_mode():
                for layer in self.slot_layers:
                    layer.move(last, row, self.state.lengths[last])
            self.state.lengths[row] = self.state.lengths[last]
            moved = last
        self.state.lengths.pop()
        return moved

    @property
    def every_layer_in_slots(self) -> bool:
        """Whether the model's whole state is in the slot layers (no layer with state of
        its own, as linear attention's): what lets a row's KV stand for its tokens."""
        return len(self.slot_layers) == len(self.cache.layers)

    def row_kv(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of ``row``'s first ``length`` positions, per slot layer: keys and
        values of shape (heads, length, dim)."""
        with torch.inference_mode():
            return [(layer._keys[row, :, :length].clone(), layer._values[row, :, :length].clone())
                    for layer in self.slot_layers]

    def begin_pass(self, nodes: int, device: torch.device) -> None:
        """Before a pass of ``nodes`` nodes per row: each row writes at its length."""
        self.state.offsets = torch.tensor(self.state.lengths, dtype=torch.long, device=device)
        self.state.span = max(self.state.lengths) + nodes
        self.state.packed_rows = self.state.packed_at = None

    def begin_packed(self, writes: list[tuple[int, int, int]], device: torch.device) -> None:
        """Before a packed pass of runs ``(row, first, size)``, one after another: a
        run's token j writes at position ``first + j`` of its row (a tree or a prompt
        chunk at the row's length, as in a padded pass; the rest of a chunk whose first
        tokens an earlier run wrote)."""
        state = self.state
        rows, firsts, sizes = (list(column) for column in zip(*writes))
        segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
        state.packed_rows = torch.tensor(rows)[segment].to(device)
        state.packed_at = (torch.tensor(firsts)[segment] + torch.arange(len(segment)) - starts[segment]).to(device)
        state.span = max(first + size for first, size in zip(firsts, sizes))

    def compact(self, row: int, path: list[int]) -> None:
        """Keep the KV of ``path`` (node indices in the pass, root first) of ``row``
        right after its context; its length grows by ``len(path)``."""
        start = self.state.lengths[row]
        if path != list(range(len(path))):
            source = torch.tensor(path, dtype=torch.long, device=self.slot_layers[0]._keys.device) + start
            with torch.inference_mode():
                for layer in self.slot_layers:
                    layer.compact(row, source, start)
        self.state.lengths[row] = start + len(path)
