"""Grouped-query attention over a tree mask without copying the KV cache.

Given a custom mask, Hugging Face's SDPA attention first repeats every key and value
head of the whole cache up to the number of query heads, because on CUDA torch's
grouped-query SDPA falls back to its slowest kernel when a mask is given. On the CPU,
torch's SDPA takes the mask and the grouped heads together, and the repeat is a copy of
the cache in every layer of every tree pass (``python -m racer.bench.measure attention``
times what that costs).

``tree_attention(model, device)`` switches the model's SDPA layers, for the duration of one
tree pass, to ``tree_sdpa``, registered with transformers' ``AttentionInterface``; no
model file or module is changed. The switch holds the model's config for that pass, so
a model shared between threads must not run another forward pass at the same time.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

NAME = "racer_tree_sdpa"
# Up to this many query positions a row (a tree pass, not a prompt chunk), the stacked
# products of ``few_query_attention`` beat torch's blocked CPU kernel
# (``racer measure attention`` times both).
FEW_QUERIES = 16
# Rows attend one by one over their own spans where padding to the longest row would be
# more than this share of the positions attended (the per-row products cost a few
# small calls a layer each).
PADDED_SHARE = 0.25
# A packed pass's attention call costs, beside its products, about what one query
# attending this many cached positions costs; a few queries of a row read each key
# together, so a row's products grow with about the square root of its queries
# (``racer measure runs`` times the layouts this model picks against the others).
CALL_KEYS = 550
# Each row's span (its context and the pass's nodes) during a batched pass, set by the
# caller around the pass (``TreeAttention.spans``).
_ROW_SPANS: ContextVar[Sequence[int] | None] = ContextVar("racer_row_spans", default=None)
# The rows of a packed pass (``PackedRows``), set by the caller around it.
_PACKED: ContextVar["PackedRows | None"] = ContextVar("racer_packed_rows", default=None)
# Keyword arguments with which some families' layers change the attention itself
# (soft-capping, sinks, position biases, windows): those calls keep the stock path.
_ALTERING = ("softcap", "position_bias", "s_aux", "sinks", "sliding_window")


@dataclass
class Segment:
    """One cache row's queries in a packed pass: packed positions ``start:end`` attend
    to the first ``span`` positions of cache row ``row`` under ``mask``, additive
    (1, 1, end - start, span). A ``prompt`` segment (a chunk of a prompt) has many
    queries and goes to torch's blocked kernel; its ``mask`` None means causal over a
    row that holds nothing before it (``span == end - start``)."""

    row: int
    start: int
    end: int
    span: int
    mask: torch.Tensor | None
    prompt: bool = False


@dataclass
class PaddedRows:
    """Consecutive cache rows ``row``..``row + B - 1`` whose trees lie one after another at
    packed positions ``start``..``end``, attended as one call over padded queries:
    ``index`` (B, N) the packed position of the group's b-th row's i-th query (its last
    node past its own), ``mask`` (B, 1, N, longest span) and ``back`` each packed node's
    place in the flattened (B * N) result."""

    index: torch.Tensor
    mask: torch.Tensor
    back: torch.Tensor
    start: int
    end: int
    row: int


def padded_groups(rows: Sequence[int], sizes: Sequence[int], spans: Sequence[int]) -> list[tuple[int, int]]:
    """A packed pass's trees (cache ``rows``, ``sizes`` nodes, each attending its row's
    first ``spans`` positions) split into runs ``(first, end)`` of consecutive trees, each
    attended by one call over queries padded to the run's largest tree and keys to its
    longest span: the split of least modelled cost (``CALL_KEYS`` a call, plus the run's
    padded rows times its longest span times the square root of its largest tree). A run
    holds consecutive cache rows only, so that its keys are a slice of the cache, not a
    copy."""
    count = len(rows)
    best = [0.0] + [float("inf")] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        span = size = 0
        for first in range(end - 1, -1, -1):
            if first < end - 1 and rows[first] + 1 != rows[first + 1]:
                break
            span, size = max(span, spans[first]), max(size, sizes[first])
            cost = best[first] + CALL_KEYS + (end - first) * span * size ** 0.5
            if cost < best[end]:
                best[end], cut[end] = cost, first
    runs = []
    end = count
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


@dataclass
class PackedRows:
    """A batched pass whose rows' queries lie one after another in a single sequence,
    so that the linear layers compute no padding: each of ``segments`` is attended on
    its own, and each of ``padded`` attends a run of tree rows in one call (where rows
    are alike, a call per row costs more in dispatch than padding costs in products). ``calls`` counts the attention calls that took the packed rows;
    ``refused`` is set by one that could not (a family whose layers change the
    attention itself), whose output is then meaningless."""

    segments: list[Segment]
    padded: list[PaddedRows] = field(default_factory=list)
    calls: int = 0
    refused: bool = False


def _packed_sdpa(packed: PackedRows, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 dropout: float, scaling: float | None, kwargs: dict) -> torch.Tensor:
    """Each packed row's queries over its own cache row: (1, packed nodes, heads, dim)."""
    rows = max([s.row + 1 for s in packed.segments] + [g.row + g.index.shape[0] for g in packed.padded])
    if (dropout or any(kwargs.get(name) is not None for name in _ALTERING) or query.shape[0] != 1
            or key.shape[0] < rows or query.shape[1] % key.shape[1]):
        packed.refused = True
        return query.new_zeros(query.shape).transpose(1, 2)
    packed.calls += 1
    heads, dim = query.shape[1], query.shape[3]
    grouped = []
    for group in packed.padded:
        index, mask, back = group.index, group.mask, group.back
        span, end = mask.shape[-1], group.row + index.shape[0]
        queries = query[0][:, index].transpose(0, 1)  # (B, heads, N, dim)
        result = _grouped_products(queries, key[group.row : end, :, :span], value[group.row : end, :, :span],
                                   mask, scaling)
        grouped.append(result.transpose(1, 2).reshape(-1, heads, dim)[back])  # (the run's nodes, heads, dim)
    if not packed.segments and len(grouped) == 1 and packed.padded[0].start == 0:
        return grouped[0].unsqueeze(0)
    out = query.new_empty(query.shape)
    for s in packed.segments:
        q = query[:, :, s.start : s.end]
        k, v = key[s.row : s.row + 1, :, : s.span], value[s.row : s.row + 1, :, : s.span]
        if s.prompt:
            out[:, :, s.start : s.end] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=s.mask, is_causal=s.mask is None, scale=scaling, enable_gqa=True)
        else:
            out[:, :, s.start : s.end] = _grouped_products(q, k, v, s.mask, scaling)
    for group, result in zip(packed.padded, grouped):
        out[0, :, group.start : group.end] = result.transpose(0, 1)
    return out.transpose(1, 2).contiguous()


def _stock_sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def tree_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked call on grouped KV heads
    attends to the cache's heads in place (``enable_gqa``) instead of to a repeated copy.
    Arguments and result as ``transformers.integrations.sdpa_attention.sdpa_attention_forward``.
    Within a packed pass (``PackedRows``), every call attends row by row."""
    packed = _PACKED.get()
    if packed is not None:
        return _packed_sdpa(packed, module, query, key, value, dropout, scaling, kwargs), None
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and key.shape[1] < query.shape[1]
    if (not grouped or attention_mask is None or attention_mask.dim() != 4 or dropout
            or any(kwargs.get(name) is not None for name in _ALTERING)):
        return _stock_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if (query.shape[2] <= FEW_QUERIES and attention_mask.is_floating_point()
            and attention_mask.shape[:3] == (query.shape[0], 1, query.shape[2])):
        out = few_query_attention(query, key, value, attention_mask[..., : key.shape[2]], scaling,
                                  _ROW_SPANS.get())
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def few_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        scaling: float | None, spans: Sequence[int] | None = None) -> torch.Tensor:
    """SDPA's math for a few query positions per row: the query heads that share a KV
    head are stacked as rows of one product with it, so each KV head of the cache is
    read once per pass, by two matrix products, instead of once per query head by the
    blocked kernel, which for a few queries mostly waits on the cache.
    ``query`` (B, H, q, d), ``key``/``value`` (B, Hkv, L, d), ``mask`` additive (B, 1, q, L).
    ``spans``: row b attends to nothing past its first ``spans[b]`` positions (its mask
    says so); where padding every row to L would be mostly such positions, each row is
    computed over its own span (what lies past it has zero weight in the softmax)."""
    batch, length = query.shape[0], key.shape[2]
    if (spans is not None and batch > 1 and len(spans) == batch and max(spans) <= length
            and sum(spans) < (1 - PADDED_SHARE) * batch * length):
        out = query.new_empty(query.shape)
        for row, span in enumerate(spans):
            out[row : row + 1] = _grouped_products(query[row : row + 1], key[row : row + 1, :, :span],
                                                   value[row : row + 1, :, :span], mask[row : row + 1, ..., :span],
                                                   scaling)
        return out
    return _grouped_products(query, key, value, mask, scaling)


def _grouped_products(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scaling: float | None) -> torch.Tensor:
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * queries, dim), key.transpose(-1, -2))
    scores = scores.mul_(scale).view(batch, kv_heads, groups, queries, length)
    scores = scores.add_(mask.unsqueeze(2)).view(batch, kv_heads, groups * queries, length)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.view(batch, heads, queries, dim)


class TreeAttention:
    """Context manager: within it, the given configs name ``tree_sdpa`` as their
    attention implementation; on leaving, each gets its own back."""

    def __init__(self, configs: list[Any]) -> None:
        self.configs = configs
        self._saved: list[Any] = []

    def __enter__(self) -> "TreeAttention":
        self._saved = [config._attn_implementation for config in self.configs]
        for config in self.configs:
            config._attn_implementation = NAME
        return self

    def __exit__(self, *exc: Any) -> None:
        for config, saved in zip(self.configs, self._saved):
            config._attn_implementation = saved

    @contextmanager
    def spans(self, spans: Sequence[int]) -> Iterator["TreeAttention"]:
        """This switch, for a batched pass in which row b attends to nothing past its
        first ``spans[b]`` cache positions (``few_query_attention``)."""
        token = _ROW_SPANS.set(list(spans))
        try:
            with self:
                yield self
        finally:
            _ROW_SPANS.reset(token)

    @contextmanager
    def packed(self, rows: PackedRows) -> Iterator["TreeAttention"]:
        """This switch, for a pass over packed rows (``PackedRows``)."""
        token = _PACKED.set(rows)
        try:
            with self:
                yield self
        finally:
            _PACKED.reset(token)


def tree_attention(model: Any, device: str) -> TreeAttention | None:
    """A ``TreeAttention`` for ``model``'s grouped-query SDPA layers (on ``device``, a
    device type), or None where it does not apply: not a CPU model, no grouped KV heads, layers that do not dispatch
    through transformers' ``AttentionInterface`` by name, a torch without
    ``enable_gqa`` (before 2.5), or an "sdpa" the user has replaced with their own."""
    try:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # transformers < 4.50
        return None
    if device != "cpu" or tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
        return None
    if ALL_ATTENTION_FUNCTIONS.get("sdpa") is not _stock_sdpa():
        return None
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(module, "num_key_value_groups", 1) <= 1 or config is None:
            continue
        # A config with sub-configs would hand the switch down to them and take their
        # own implementations away on the way back.
        if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "sub_configs", None):
            return None
        # Layers that pick their attention function by the config's name look it up
        # in the registry their modeling file imports.
        if not hasattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS"):
            return None
        configs[id(config)] = config
    if not configs:
        return None
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, tree_sdpa)
    return TreeAttention(list(configs.values()))
