"""Where the engine keeps its requests' KV, one row per request decoding, and how it
verifies every row's tree in one pass.

``OneRow`` holds one request in the engine's own ``TreeVerifier``: the request is
prefilled straight into the cache it decodes on (a growing cache: no copy), and a
chain is verified without a mask where the model's own causal mask does. ``SlotRows``
holds many in a ``SlotCache``: every pass pads the rows' trees to the largest and
gives each row its own positions and masks (its own context within its layers'
windows, its own ancestors), so no request sees another's tokens.

Design choice: one cache row per request with per-row lengths, rather than one
flattened cache whose mask separates requests: a flattened cache would attend every
query to every request's KV (B times the attention work), while rows attend only to
their own. The pass itself is packed where the model allows it (``PackedRows``): the
rows' trees lie one after another in one sequence, so the linear layers, which cost
most on a CPU, compute no padding, and each row's queries attend to their own cache
row. Elsewhere (windowed layers, families whose attention calls alter the attention,
devices without tree attention) every tree is padded to the largest.

``SlotRows`` can also keep finished requests' KV (``racer.engine.prefixes``) and start
a later request of the same scope from the longest kept prefix of its prompt.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Hashable, Iterator, Protocol, Sequence

import numpy as np
import torch

from racer.drafting.tree import DraftTree
from racer.engine.prefixes import Prefix, PrefixStore
from racer.engine.slots import SlotCache
from racer.engine.verifier import TreeVerifier
from racer.engine.windows import indexed_windows
from racer.fastpaths.attention import PADDED_SHARE, PackedRows


class Rows(Protocol):
    """What the engine asks of its KV rows."""

    lengths: list[int]  # each row's cached tokens (the context but its last token)
    packs: bool  # whether a pass lays the rows' trees one after another, unpadded

    def prefill_verifier(self, ids: Sequence[int] = (), scope: Hashable | None = None) -> tuple[TreeVerifier, int]:
        """A verifier to prefill a new request of ``ids`` on (``admit`` then takes it
        in), and how many of its leading tokens it already holds (a kept prefix)."""

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        """Before ``row`` is released: keep its KV for later prompts that begin with
        ``tokens`` (its context), where the rows keep prefixes."""

    def admit(self, prefilled: TreeVerifier) -> int:
        """Take in a prefilled request; returns its row, the last."""

    def release(self, row: int) -> int | None:
        """Free ``row``; returns the row that moved into it, if one did."""

    def forward(self, trees: list[DraftTree]) -> torch.Tensor:
        """Logits at every node of every row's tree: (rows, nodes, vocab), padded."""

    def commit(self, row: int, path: list[int], tree_size: int) -> None:
        """Keep ``path`` of ``row``'s last tree after its context, drop the rest."""


class OneRow:
    """One request at a time, in ``verifier``'s own cache."""

    packs = False

    def __init__(self, verifier: TreeVerifier) -> None:
        self.verifier = verifier
        self.held = False

    @property
    def lengths(self) -> list[int]:
        return [self.verifier.cached] if self.held else []

    def prefill_verifier(self, ids: Sequence[int] = (), scope: Hashable | None = None) -> tuple[TreeVerifier, int]:
        if self.held:
            raise RuntimeError("rows: one request at a time")
        return self.verifier, 0

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        pass

    def admit(self, prefilled: TreeVerifier) -> int:
        if prefilled is not self.verifier or self.held:
            raise RuntimeError("rows: one request at a time, prefilled on the row's own verifier")
        self.held = True
        return 0

    def release(self, row: int) -> int | None:
        self.held = False
        return None

    def forward(self, trees: list[DraftTree]) -> torch.Tensor:
        return self.verifier.verify(trees[0])[None]

    def commit(self, row: int, path: list[int], tree_size: int) -> None:
        self.verifier.commit(path, tree_size)


class SlotRows:
    """Many requests in one ``SlotCache``, verified together."""

    def __init__(self, verifier: TreeVerifier, config: Any, prefix_bytes: int = 0, rows: int = 1) -> None:
        self.verifier = verifier
        self.slots = SlotCache(config, rows)
        self.prefixes = PrefixStore(prefix_bytes if self.slots.every_layer_in_slots else 0)
        # Whether passes are packed: decided by the model's layout, then by the first
        # packed pass (an attention call that cannot take packed rows turns it off).
        self.packs = (verifier.fast_paths.packed_rows and verifier.tree_attention is not None
                      and not verifier.layout.windowed and self.slots.every_layer_in_slots)

    @property
    def lengths(self) -> list[int]:
        return self.slots.state.lengths

    def prefill_verifier(self, ids: Sequence[int] = (), scope: Hashable | None = None) -> tuple[TreeVerifier, int]:
        v = self.verifier
        verifier = TreeVerifier(v.model, v.fast_paths, v.facts, v.layout)
        prefix, length = self.prefixes.longest(scope, ids)
        if prefix is not None:
            verifier.resume(prefix.kv, length)
        return verifier, length

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        length = min(self.lengths[row], len(tokens))
        if self.prefixes.wants(scope, length):
            self.prefixes.put(scope, Prefix(np.asarray(tokens[:length], dtype=np.int64), self.slots.row_kv(row, length)))

    def admit(self, prefilled: TreeVerifier) -> int:
        return self.slots.admit(prefilled.cache, prefilled.cached)

    def release(self, row: int) -> int | None:
        return self.slots.release(row)

    def commit(self, row: int, path: list[int], tree_size: int) -> None:
        self.slots.compact(row, path)

    @contextmanager
    def only(self, rows: int, length: int) -> Iterator[None]:
        """For a timing: the first ``rows`` rows, each ``length`` tokens long, until
        the block ends."""
        state = self.slots.state
        held = state.lengths
        state.lengths = [length] * rows
        try:
            yield
        finally:
            state.lengths = held

    def forward(self, trees: list[DraftTree]) -> torch.Tensor:
        if self.packs and len(trees) > 1:
            logits = self._packed_forward(trees)
            if logits is not None:
                return logits
            self.packs = False
        return self._padded_forward(trees)

    def _packed_forward(self, trees: list[DraftTree]) -> torch.Tensor | None:
        """The pass with every row's tree in one sequence; None where an attention call
        could not take packed rows (nothing of that pass is used: a padded pass writes
        the same cache positions again)."""
        v, device = self.verifier, self.verifier.device
        sizes = [len(tree) for tree in trees]
        lengths = self.lengths
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        ids = torch.tensor([[t for tree in trees for t in tree.tokens]], dtype=torch.long, device=device)
        positions = torch.tensor([[d + length for tree, length in zip(trees, lengths) for d in tree.depths]],
                                 dtype=torch.long, device=device)
        allowed = [self._visible(tree, length) for tree, length in zip(trees, lengths)]
        spans = [length + size for length, size in zip(lengths, sizes)]
        # One attention call over padded queries where padding adds little attention work
        # (at long contexts a query's attention costs about what its linear layers do).
        if sum(n * span for n, span in zip(sizes, spans)) >= (1 - PADDED_SHARE) * len(sizes) * max(sizes) * max(spans):
            packed = PackedRows(starts, spans, padded=self._padded_attention(starts, sizes, allowed, max(spans)))
        else:
            lowest = torch.finfo(v.dtype).min
            packed = PackedRows(starts, spans, [
                torch.full((1, 1, *seen.shape), lowest, dtype=v.dtype, device=device).masked_fill_(seen, 0)
                for seen in allowed])
        self.slots.begin_packed(sizes, device)
        # The model takes a prepared 4D mask as it is; the rows' own masks are in ``packed``.
        placeholder = torch.zeros((1, 1, starts[-1], 1), dtype=v.dtype, device=device)
        linear = v.kernels.using(v.kernel_of(starts[-1]))
        try:
            with linear, v.tree_attention.packed(packed):
                logits = v.forward(ids, positions, placeholder, 0, cache=self.slots.cache, batched=True)
        finally:
            self.slots.state.packed_rows = self.slots.state.packed_at = None
        if packed.refused or packed.calls != len(self.slots.slot_layers):
            return None
        return logits[0][self._padded_index(starts, sizes)]

    def _padded_index(self, starts: list[int], sizes: list[int]) -> torch.Tensor:
        """(rows, largest size): where row b's i-th node lies in the packed pass (its last
        node past its own)."""
        nodes = max(sizes)
        return torch.tensor([[start + min(i, size - 1) for i in range(nodes)]
                             for start, size in zip(starts[:-1], sizes)], dtype=torch.long, device=self.verifier.device)

    def _padded_attention(self, starts: list[int], sizes: list[int], allowed: list[torch.Tensor],
                          span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``PackedRows.padded``: the packed pass's attention as one call over padded rows,
        a padding query a copy of its row's last node."""
        v, nodes = self.verifier, max(sizes)
        mask = torch.full((len(sizes), 1, nodes, span), torch.finfo(v.dtype).min, dtype=v.dtype, device=v.device)
        for row, (size, seen) in enumerate(zip(sizes, allowed)):
            own = mask[row, 0, :, : seen.shape[-1]]
            own[:size].masked_fill_(seen, 0)
            own[size:] = own[size - 1]
        back = torch.tensor([row * nodes + i for row, size in enumerate(sizes) for i in range(size)],
                            dtype=torch.long, device=v.device)
        return self._padded_index(starts, sizes), mask, back

    def _padded_forward(self, trees: list[DraftTree]) -> torch.Tensor:
        v, device = self.verifier, self.verifier.device
        rows, nodes = len(trees), max(len(tree) for tree in trees)
        lengths = self.lengths
        ids = torch.zeros((rows, nodes), dtype=torch.long)
        positions = torch.zeros((rows, nodes), dtype=torch.long)
        for row, tree in enumerate(trees):
            ids[row, : len(tree)] = torch.tensor(tree.tokens)
            ids[row, len(tree):] = tree.tokens[0]
            positions[row, : len(tree)] = torch.tensor(tree.depths) + lengths[row]
            positions[row, len(tree):] = lengths[row]
        self.slots.begin_pass(nodes, device)
        mask = self._masks(trees, nodes)
        linear = v.kernels.using(v.kernel_of(rows * nodes))
        # Row b's nodes sit at lengths[b].. and it attends to nothing past them.
        attention = (v.tree_attention.spans([length + nodes for length in lengths])
                     if v.tree_attention is not None else nullcontext())
        with linear, attention, indexed_windows(v.layout, mask) as model_mask:
            return v.forward(ids.to(device), positions.to(device), model_mask, nodes, cache=self.slots.cache,
                             batched=True)

    def _visible(self, tree: DraftTree, length: int) -> Any:
        """What each of ``tree``'s nodes sees of a row of ``length`` cached tokens and of
        the tree (``racer.engine.windows``: one boolean (nodes, length + nodes) mask, or
        one per mask the model takes)."""
        v = self.verifier
        depths = torch.tensor(tree.depths, dtype=torch.long, device=v.device)
        ancestors = torch.from_numpy(tree.ancestor_mask()).to(v.device)
        return v.layout.visible(length, depths, ancestors, max(tree.depths))

    def _masks(self, trees: list[DraftTree], nodes: int) -> Any:
        """Each row's masks (``racer.engine.windows``), placed in a padded
        (rows, 1, nodes, span) tensor per mask the model takes; padding nodes see only
        themselves."""
        v, span = self.verifier, self.slots.state.span
        lowest = torch.finfo(v.dtype).min
        padded: dict[str, torch.Tensor] = {}
        for row, tree in enumerate(trees):
            length, size = self.lengths[row], len(tree)
            seen = self._visible(tree, length)
            for key, allowed in (seen.items() if isinstance(seen, dict) else [("", seen)]):
                if key not in padded:
                    padded[key] = torch.full((len(trees), 1, nodes, span), lowest, dtype=v.dtype, device=v.device)
                padded[key][row, 0, :size, : length + size].masked_fill_(allowed, 0)
                pads = torch.arange(size, nodes, device=v.device)
                padded[key][row, 0, pads, length + pads] = 0
        return padded[""] if "" in padded else padded
