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

A joining request's prompt is prefilled in chunks (``Chunk``). Where passes are packed,
the request takes its row before its prefill, and a chunk can ride as one more segment
of the step's pass, before the rows' trees (the engine says which do), and the prompt's
KV is written where the request will decode. Elsewhere a chunk is a pass of its own, on
a verifier of the request's own until ``admit`` copies its KV into a row.

``SlotRows`` can also keep finished requests' KV (``racer.engine.prefixes``) and start
a later request of the same scope from the longest kept prefix of its prompt.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Protocol, Sequence

import numpy as np
import torch

from racer.drafting.tree import DraftTree, chain
from racer.engine.prefixes import Prefix, PrefixStore, common_prefix
from racer.engine.slots import SlotCache
from racer.engine.verifier import TreeVerifier
from racer.engine.windows import indexed_windows
from racer.fastpaths.attention import PackedRows, PaddedRows, Segment, padded_groups


@dataclass
class Prompt:
    """A request's prompt while it is prefilled (``Rows.begin_prompt``): how many of its
    leading tokens are cached, and where: in ``row`` (rows that pack), or on
    ``verifier`` until ``Rows.admit`` takes it into a row."""

    cached: int
    row: int | None = None
    verifier: TreeVerifier | None = None


@dataclass
class Chunk:
    """The next ``tokens`` of ``prompt``, for one pass: the logits at their last ``keep``
    positions (0: at every one) go to ``logits``, (kept, vocab); ``places``, set by the
    pass, says where its tokens lay in it, in order (a slice of the pass's positions, or
    two where the pass put its kept positions apart)."""

    prompt: Prompt
    tokens: list[int]
    keep: int
    logits: torch.Tensor | None = None
    places: list[slice] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return len(self.tokens) if self.keep == 0 else min(self.keep, len(self.tokens))

    def rows_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The chunk's tokens' rows of ``hidden``, one row per position of its pass."""
        parts = [hidden[place] for place in self.places]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class Rows(Protocol):
    """What the engine asks of its KV rows."""

    lengths: list[int]  # each row's cached tokens (the context but its last token)
    packs: bool  # whether a pass lays the rows' trees one after another, unpadded (and takes a prompt chunk)

    def begin_prompt(self, ids: Sequence[int], scope: Hashable | None = None) -> Prompt:
        """Where a new request of ``ids`` is prefilled, starting after the longest kept
        prefix of its prompt (``Prompt.cached``) where the rows keep prefixes."""

    def prefill(self, chunks: list[Chunk]) -> None:
        """Cache ``chunks`` (of different prompts; more than one only where the rows
        pack) in a pass of their own (each one's logits in its ``logits``)."""

    def waits_for(self, scope: Hashable | None, ids: Sequence[int], others: Sequence[Sequence[int]]) -> bool:
        """Whether a new prompt of ``ids`` would start from more of its tokens once the
        prompts ``others`` (of ``scope``, being prefilled) are kept than it would now."""

    def admit(self, prompt: Prompt) -> int:
        """The prefilled request decodes from now on; returns its row."""

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        """Keep ``row``'s KV for later prompts that begin with ``tokens`` (its prompt,
        once prefilled; its context, before the row is released), where the rows keep
        prefixes."""

    def release(self, row: int) -> int | None:
        """Free ``row``; returns the row that moved into it, if one did."""

    def forward(self, trees: list[DraftTree], rows: Sequence[int] | None = None,
                chunk: Chunk | None = None) -> torch.Tensor:
        """Logits at every node of every tree, tree i on row ``rows[i]`` (default: row
        i): (trees, nodes, vocab), padded. ``chunk``, where the rows pack: cached in the
        same pass (its logits in ``chunk.logits``)."""

    def commit(self, row: int, path: list[int], tree_size: int) -> None:
        """Keep ``path`` of ``row``'s last tree after its context, drop the rest."""


def prefill_on(verifier: TreeVerifier, chunk: Chunk) -> None:
    """``chunk`` cached on ``verifier``, a pass of its own."""
    tokens = chunk.tokens
    if verifier.cached == 0:
        chunk.logits = verifier.prefill(tokens, keep=chunk.keep)
    else:
        chunk.logits = verifier.verify(chain(tokens[0], tokens[1:]), keep=chunk.keep)
        verifier.commit(list(range(len(tokens))), len(tokens))
    chunk.prompt.cached = verifier.cached
    chunk.places = [slice(0, len(tokens))]


class OneRow:
    """One request at a time, in ``verifier``'s own cache."""

    packs = False

    def __init__(self, verifier: TreeVerifier) -> None:
        self.verifier = verifier
        self.held = False

    @property
    def lengths(self) -> list[int]:
        return [self.verifier.cached] if self.held else []

    def begin_prompt(self, ids: Sequence[int], scope: Hashable | None = None) -> Prompt:
        if self.held:
            raise RuntimeError("rows: one request at a time")
        self.verifier.cached = 0
        return Prompt(0, verifier=self.verifier)

    def prefill(self, chunks: list[Chunk]) -> None:
        if len(chunks) != 1:
            raise RuntimeError("rows: one prompt chunk a pass")
        prefill_on(self.verifier, chunks[0])

    def waits_for(self, scope: Hashable | None, ids: Sequence[int], others: Sequence[Sequence[int]]) -> bool:
        return False

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        pass

    def admit(self, prompt: Prompt) -> int:
        if prompt.verifier is not self.verifier or self.held:
            raise RuntimeError("rows: one request at a time, prefilled on the row's own verifier")
        self.held = True
        return 0

    def release(self, row: int) -> int | None:
        self.held = False
        return None

    def forward(self, trees: list[DraftTree], rows: Sequence[int] | None = None,
                chunk: Chunk | None = None) -> torch.Tensor:
        if chunk is not None or len(trees) != 1:
            raise RuntimeError("rows: one tree a pass, and no prompt chunk in it")
        return self.verifier.verify(trees[0])[None]

    def commit(self, row: int, path: list[int], tree_size: int) -> None:
        self.verifier.commit(path, tree_size)


class SlotRows:
    """Many requests in one ``SlotCache``, verified together."""

    def __init__(self, verifier: TreeVerifier, config: Any, prefix_bytes: int = 0, rows: int = 1) -> None:
        self.verifier = verifier
        self.config = config
        self.slots = SlotCache(config, rows)
        self.prefixes = PrefixStore(prefix_bytes if self.slots.every_layer_in_slots else 0)
        # Whether passes are packed: decided by the model's layout and one probe pass
        # (a family whose attention calls cannot take packed rows pads).
        self.packs = (verifier.fast_paths.packed_rows and verifier.tree_attention is not None
                      and not verifier.layout.windowed and self.slots.every_layer_in_slots and self._packing_works())

    def _packing_works(self) -> bool:
        """One packed pass of two one-token rows on a cache of its own: whether every
        attention layer took the packed rows."""
        held = self.slots
        self.slots = SlotCache(self.config, 2)
        try:
            for _ in range(2):
                self.slots.admit_kv([], 0)
            return self._packed_forward([DraftTree.single(0)] * 2, [0, 1]) is not None
        finally:
            self.slots = held

    @property
    def lengths(self) -> list[int]:
        return self.slots.state.lengths

    def begin_prompt(self, ids: Sequence[int], scope: Hashable | None = None) -> Prompt:
        prefix, length = self.prefixes.longest(scope, ids)
        if self.packs:
            return Prompt(length, row=self.slots.admit_kv(prefix.kv if prefix is not None else [], length))
        v = self.verifier
        verifier = TreeVerifier(v.model, v.fast_paths, v.facts, v.layout)
        if prefix is not None:
            verifier.resume(prefix.kv, length)
        return Prompt(length, verifier=verifier)

    def prefill(self, chunks: list[Chunk]) -> None:
        if len(chunks) == 1 and chunks[0].prompt.row is None:
            prefill_on(chunks[0].prompt.verifier, chunks[0])
            return
        if not self.packs or any(chunk.prompt.row is None for chunk in chunks):
            raise RuntimeError("rows: prompt chunks share a pass only where the rows pack, each on its own row")
        if self._packed_forward([], [], chunks) is None:
            raise RuntimeError("rows: an attention call refused packed rows that the probe pass took")

    def waits_for(self, scope: Hashable | None, ids: Sequence[int], others: Sequence[Sequence[int]]) -> bool:
        if not others or not self.prefixes.wants(scope, self.prefixes.minimum):
            return False
        wanted = np.asarray(ids, dtype=np.int64)
        shared = max(common_prefix(np.asarray(other, dtype=np.int64), wanted) for other in others)
        shared = min(shared, len(wanted) - 1)  # the last token is always computed
        return shared >= self.prefixes.minimum and shared > self.prefixes.reusable(scope, ids)

    def admit(self, prompt: Prompt) -> int:
        if prompt.row is not None:
            return prompt.row
        return self.load(prompt.verifier)

    def load(self, prefilled: TreeVerifier) -> int:
        """Copy a request prefilled on a verifier of its own into a new last row."""
        return self.slots.admit(prefilled.cache, prefilled.cached)

    def keep(self, row: int, scope: Hashable | None, tokens: Sequence[int]) -> None:
        length = min(self.lengths[row], len(tokens))
        if self.prefixes.wants(scope, length) and not self.prefixes.holds(scope, tokens[:length]):
            self.prefixes.put(scope, Prefix(np.asarray(tokens[:length], dtype=np.int64), self.slots.row_kv(row, length)))

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

    def forward(self, trees: list[DraftTree], rows: Sequence[int] | None = None,
                chunk: Chunk | None = None) -> torch.Tensor:
        rows = list(range(len(trees))) if rows is None else list(rows)
        every = list(range(len(self.lengths)))
        if chunk is not None or (self.packs and (len(trees) > 1 or rows != every)):
            if not self.packs or chunk is not None and chunk.prompt.row is None:
                raise RuntimeError("rows: a prompt chunk rides only in a packed pass, on the prompt's own row")
            logits = self._packed_forward(trees, rows, [chunk] if chunk is not None else [])
            if logits is None:
                raise RuntimeError("rows: an attention call refused packed rows that the probe pass took")
            return logits
        if rows != every:
            raise RuntimeError(f"rows: a padded pass covers every row in order, got rows {rows}")
        return self._padded_forward(trees)

    def _packed_forward(self, trees: list[DraftTree], rows: list[int],
                        chunks: Sequence[Chunk] = ()) -> torch.Tensor | None:
        """The pass with ``chunks``' tokens first (if any), then every tree, in one
        sequence; None where an attention call could not take packed rows. The positions
        whose logits are kept end the sequence, so that the LM head computes no others:
        the last chunk's, then each other chunk's kept positions (a segment apart from
        the rest of its chunk, which comes first), then the trees'."""
        v, device = self.verifier, self.verifier.device
        lengths = self.lengths
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        writes: list[tuple[int, int, int]] = []  # each run of the pass: its row, first position, tokens

        def place(chunk: Chunk, first: int, count: int) -> None:
            """``count`` of ``chunk``'s tokens from its ``first``, next in the sequence."""
            if count == 0:
                return
            row, start = chunk.prompt.row, len(ids)
            before = lengths[row] + first
            ids.extend(chunk.tokens[first : first + count])
            positions.extend(range(before, before + count))
            segments.append(Segment(row, start, start + count, before + count, self._prompt_mask(before, count),
                                    prompt=True))
            writes.append((row, before, count))
            chunk.places.append(slice(start, start + count))

        for chunk in chunks:
            chunk.places = []
        for chunk in chunks[:-1]:
            place(chunk, 0, len(chunk.tokens) - chunk.kept)
        if chunks:
            place(chunks[-1], 0, len(chunks[-1].tokens))
        for chunk in chunks[:-1]:
            place(chunk, len(chunk.tokens) - chunk.kept, chunk.kept)
        sizes = [len(tree) for tree in trees]
        starts = []
        for tree, row in zip(trees, rows):
            starts.append(len(ids))
            ids += tree.tokens
            positions += [d + lengths[row] for d in tree.depths]
            writes.append((row, lengths[row], len(tree)))
        total = len(ids)
        padded: list[PaddedRows] = []
        if trees:
            allowed = [self._visible(tree, lengths[row]) for tree, row in zip(trees, rows)]
            spans = [lengths[row] + size for row, size in zip(rows, sizes)]
            for first, end in padded_groups(rows, sizes, spans):
                if end - first == 1:
                    segments.append(Segment(rows[first], starts[first], starts[first] + sizes[first], spans[first],
                                            self._additive(allowed[first])))
                    continue
                run = slice(first, end)
                index, mask, back = self._padded_attention(starts[run], sizes[run], allowed[run], max(spans[run]))
                stop = starts[end] if end < len(starts) else total
                padded.append(PaddedRows(index, mask, back, starts[first], stop, rows[first]))
        packed = PackedRows(segments, padded)
        self.slots.begin_packed(writes, device)
        # The model takes a prepared 4D mask as it is; the rows' own masks are in ``packed``.
        placeholder = torch.zeros((1, 1, total, 1), dtype=v.dtype, device=device)
        linear = v.kernels.using(v.kernel_of(total))
        kept = sum(chunk.kept for chunk in chunks) + sum(sizes)  # a chunk's head only where asked
        ids_t = torch.tensor([ids], dtype=torch.long, device=device)
        positions_t = torch.tensor([positions], dtype=torch.long, device=device)
        try:
            with linear, v.tree_attention.packed(packed):
                logits = v.forward(ids_t, positions_t, placeholder, kept, cache=self.slots.cache, batched=True)[0]
        finally:
            self.slots.state.packed_rows = self.slots.state.packed_at = None
        if packed.refused or packed.calls != len(self.slots.slot_layers):
            return None
        base = total - kept  # packed position of the first row of ``logits``
        for chunk in chunks:
            end = chunk.places[-1].stop - base
            chunk.logits = logits[end - chunk.kept : end]
            self.slots.state.lengths[chunk.prompt.row] += len(chunk.tokens)
            chunk.prompt.cached = self.slots.state.lengths[chunk.prompt.row]
        if not trees:
            return logits[:0, None]
        return logits[self._padded_index([start - base for start in starts], sizes)]

    def _prompt_mask(self, length: int, n: int) -> torch.Tensor | None:
        """A prompt chunk of ``n`` tokens after ``length`` cached ones: each sees the row
        and itself causally (None where the row holds nothing: the causal kernel's case)."""
        if length == 0:
            return None
        device = self.verifier.device
        return self._additive(torch.arange(length + n, device=device)[None, :]
                              <= length + torch.arange(n, device=device)[:, None])

    def _additive(self, seen: torch.Tensor) -> torch.Tensor:
        """A boolean (queries, keys) visibility as the additive (1, 1, queries, keys) mask
        attention takes."""
        v = self.verifier
        mask = torch.full((1, 1, *seen.shape), torch.finfo(v.dtype).min, dtype=v.dtype, device=v.device)
        return mask.masked_fill_(seen, 0)

    def _padded_index(self, starts: list[int], sizes: list[int]) -> torch.Tensor:
        """(rows, largest size): where row b's i-th node lies in the packed pass, row b's
        tree starting at ``starts[b]`` (its last node past its own)."""
        nodes = max(sizes)
        return torch.tensor([[start + min(i, size - 1) for i in range(nodes)]
                             for start, size in zip(starts, sizes)], dtype=torch.long, device=self.verifier.device)

    def _padded_attention(self, starts: list[int], sizes: list[int], allowed: list[torch.Tensor],
                          span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A ``PaddedRows``' index, mask and result order: a run of a packed pass's rows
        attended as one call over padded queries, a padding query a copy of its row's last
        node."""
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
