"""Which keys each layer may attend to, read from the model's config, and racer's own
per-layer tree masks that say so.

A tree node at absolute position p attends to the keys its layer allows at p: a full
layer every earlier key, a sliding window of w the keys at positions > p - w, a chunked
layer the keys of p's chunk. The masks are built from positions (cache slot c holds
position c, tree node i sits at ``cached + depth(i)``), so the modeling code's own
window arithmetic, which counts rows of the pass, never sees tree rows. Windowed layers
keep every position in their cache (``racer.fastpaths.kvcache``), so compaction is the
same for all layers; the cost is that a windowed layer's KV grows with the context
instead of stopping at its window.

Models whose config names ``layer_types`` take one mask per layer type (a dict keyed by
type); the others take one mask for all layers, so their layers must share a window.
GPT-Neo's local layers place their window by row index inside the attention module
itself; for tree passes racer hands those modules the global causal buffer and its own
windowed mask (``IndexedWindow``). ``racer.engine.support`` reads the layout from the
config and refuses what it cannot express.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"


@dataclass(frozen=True)
class Window:
    """Which keys a layer attends to: ``full``; ``sliding`` (``size`` w: positions
    > p - w); ``chunked`` (``size`` c: the positions of p's chunk of c)."""

    kind: str = FULL
    size: int | None = None

    def reaches(self, last: int) -> bool:
        """Whether this window leaves out any key of a pass whose last position is ``last``."""
        return self.kind != FULL and last >= self.size

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """(queries, keys) bool: which keys a sliding or chunked window lets each query
        see (causality and the tree's ancestry are the caller's; a full layer sees all)."""
        q, k = query_pos[:, None], key_pos[None, :]
        if self.kind == SLIDING:
            return k > q - self.size
        return torch.div(k, self.size, rounding_mode="floor") == torch.div(q, self.size, rounding_mode="floor")


@dataclass(frozen=True)
class AttentionLayout:
    """Each layer's window, and how the model takes masks."""

    windows: tuple[Window, ...]  # one per layer that attends
    keyed: dict[str, Window] | None = None  # layer type -> window, for models that take a dict of masks
    indexed: tuple["IndexedWindow", ...] = ()  # GPT-Neo-style modules that window by row index

    @property
    def windowed(self) -> bool:
        return any(w.kind != FULL for w in self.windows)

    def shortest(self, limit: int) -> int | None:
        """The shortest window shorter than ``limit`` positions (None if none)."""
        return min((w.size for w in self.windows if w.kind != FULL and w.size < limit), default=None)

    def longest(self, limit: int) -> int:
        """The longest window shorter than ``limit`` positions (0 if none)."""
        return max((w.size for w in self.windows if w.kind != FULL and w.size < limit), default=0)

    def visible(self, cached: int, depths: torch.Tensor, ancestors: torch.Tensor,
                deepest: int) -> "torch.Tensor | dict[str, torch.Tensor]":
        """Which keys each node of a pass may attend to, (N, cached + N) bool, for tree
        nodes at depths ``depths`` (from a root at position ``cached``) whose ancestry is
        ``ancestors`` (N, N bool, self included): one matrix, or one per mask the model
        takes (a dict, keyed as ``masks``). ``deepest``: the largest depth (known on the
        host, so nothing is read back). Windows that leave no key out share one matrix."""
        n = depths.shape[0]
        query_pos = depths + cached
        key_pos = torch.cat([torch.arange(cached, device=depths.device), query_pos])
        base = torch.ones((n, cached + n), dtype=torch.bool, device=depths.device)
        base[:, cached:] = ancestors
        last = cached + deepest
        built: dict[Window, torch.Tensor] = {}

        def of(window: Window) -> torch.Tensor:
            if not window.reaches(last):
                window = Window()
            if window not in built:
                built[window] = base if window.kind == FULL else base & window.allowed(query_pos, key_pos)
            return built[window]

        if self.keyed is not None:
            return {kind: of(window) for kind, window in self.keyed.items()}
        if self.indexed:  # GPT-Neo: the model's mask is the global one; local modules get theirs
            return {"shared": of(Window()), **{m.key: of(m.window) for m in self.indexed}}
        return of(self.windows[0])  # one mask for every layer: they share one window

    def masks(self, cached: int, depths: torch.Tensor, ancestors: torch.Tensor, dtype: torch.dtype,
              deepest: int) -> "torch.Tensor | dict[str, torch.Tensor]":
        """``visible`` as the model takes it: additive (1, 1, N, cached + N) masks in
        ``dtype``, 0 where a node may attend, the dtype's minimum elsewhere."""
        seen = self.visible(cached, depths, ancestors, deepest)
        made: dict[int, torch.Tensor] = {}

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            if id(allowed) not in made:
                mask = torch.zeros((1, 1, *allowed.shape), dtype=dtype, device=allowed.device)
                made[id(allowed)] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            return made[id(allowed)]

        return {key: additive(a) for key, a in seen.items()} if isinstance(seen, dict) else additive(seen)


class IndexedWindow:
    """A GPT-Neo local attention module: its ``bias`` buffer windows by row index, so for
    a tree pass it gets the global causal buffer and racer's windowed mask instead."""

    def __init__(self, module: Any, window: Window, causal: torch.Tensor) -> None:
        self.module, self.window, self.causal = module, window, causal
        self.key = f"indexed:{window.size}"

    @contextmanager
    def using(self, mask: torch.Tensor) -> Iterator[None]:
        own = self.module.bias

        def hand_mask(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return args, {**kwargs, "attention_mask": mask}

        handle = self.module.register_forward_pre_hook(hand_mask, with_kwargs=True)
        self.module.bias = self.causal
        try:
            yield
        finally:
            handle.remove()
            self.module.bias = own


@contextmanager
def indexed_windows(layout: AttentionLayout, masks: Any) -> Iterator[Any]:
    """Within it, GPT-Neo local modules use their windowed mask; yields the mask the
    model itself takes."""
    if not layout.indexed or masks is None:
        yield masks
        return
    with ExitStack() as stack:
        for module in layout.indexed:
            stack.enter_context(module.using(masks[module.key]))
        yield masks["shared"]
