"""What racer can verify: the model's attention layout read from its config (every way
a config declares locality: ``layer_types``, ``sliding_window``, ``attention_chunk_size``,
GPT-Neo's ``attention_types``/``window_size``), and a clear refusal of what it cannot
express: recurrent, convolution or linear-attention state, ALiBi, attention
implementations that take no custom mask, layer types or locality settings it does not
know, cache layers holding more than keys and values.
"""

from __future__ import annotations

from typing import Any

import torch

from racer.engine.model_facts import text_config
from racer.engine.windows import CHUNKED, FULL, SLIDING, AttentionLayout, IndexedWindow, Window
from racer.fastpaths.kvcache import growing_cache


class UnsupportedModelError(ValueError):
    """The model cannot verify a tree losslessly with racer's masks."""


# Layer types of transformers' configs and caches.
_ATTENTION = {"full_attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED}
_NO_KV = {"dummy", "moe", "mlp"}  # layers that read another layer's KV, or have no attention
# Layers with a recurrent, convolution or linear-attention state: one pass over a
# branching tree would run every node through one state, in row order.
_STATEFUL = {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "mamba2", "ssm", "recurrent",
             "rnn", "short_conv", "deltanet", "gated_deltanet", "lightning_attention", "rwkv", "mlstm", "slstm"}
# Config attributes about locality that this module reads (or knows to be inert); any
# other set attribute naming a window or chunk is refused rather than guessed at.
_READ = {"sliding_window", "use_sliding_window", "max_window_layers", "window_size", "attention_chunk_size",
         "sliding_window_pattern", "_sliding_window_pattern", "attention_layers", "attention_types",
         "layer_types", "chunk_size_feed_forward"}


# Families whose layers keep no per-token KV (state-space / recurrent) or that add
# position information the mask cannot express.
_RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma",
                    "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "xlstm"}
_ALIBI_TYPES = {"bloom", "mpt", "falcon"}  # falcon only when config.alibi
# Cache layer classes whose per-token state is only keys and values (what compaction moves).
_CACHE_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer", "GrowingLayer"}


def check_supported(model: Any) -> AttentionLayout:
    """The model's attention layout, or ``UnsupportedModelError`` saying why racer
    cannot verify trees on it."""
    config = model.config
    kind = getattr(config, "model_type", "?")
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn.startswith("flash") or attn.startswith("flex") or "paged" in attn:
        raise UnsupportedModelError(
            f"attn_implementation={attn!r} cannot take a custom 4D tree mask; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if kind in _RECURRENT_TYPES:
        raise UnsupportedModelError(f"model type {kind!r} has recurrent/state-space layers; tree verification "
                                    "needs attention KV")
    if kind in _ALIBI_TYPES and (kind != "falcon" or getattr(config, "alibi", False)):
        raise UnsupportedModelError(f"model type {kind!r} uses ALiBi, whose bias the tree mask would misplace")
    found = layout(model)
    try:
        cache = growing_cache(model.config)
    except Exception as err:  # noqa: BLE001 - an exotic config: say so, not where it broke
        raise UnsupportedModelError(f"model type {kind!r}: transformers builds no KV cache for this config "
                                    f"({type(err).__name__}: {err})") from err
    for index, layer in enumerate(getattr(cache, "layers", None) or []):
        if type(layer).__name__ not in _CACHE_LAYERS:
            raise UnsupportedModelError(f"model type {kind!r} layer {index}: cache layer {type(layer).__name__} keeps "
                                        "state besides keys and values, which racer cannot compact")
    return found


def _layer_types(config: Any) -> tuple[list[str] | None, list[dict]]:
    """The config's layer types and each layer's window arguments, as transformers' own
    caches read them (None where the config names none and transformers cannot say)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        try:
            types, kwargs = get_layer_types_and_kwargs(config)
            return list(types), list(kwargs)
        except (AttributeError, TypeError):
            pass
    types = getattr(config, "layer_types", None)
    if types is None:
        return None, []
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    return list(types), [{"sliding_window": chunk if t == "chunked_attention" else window} for t in types]


def _window_of(kind: str, size: Any, where: str) -> Window:
    if kind == FULL:
        return Window()
    if not isinstance(size, int) or size <= 0:
        raise UnsupportedModelError(f"{where}: a {kind} window needs a positive size, the config gives {size!r}")
    return Window(kind, size)


def _unread_locality(config: Any) -> list[str]:
    names = []
    for name, value in vars(config).items():
        if ("window" in name or "chunk" in name) and name not in _READ and value not in (None, 0, False, [], ()):
            names.append(f"{name}={value!r}")
    return names


def layout(model: Any) -> AttentionLayout:
    """The model's attention layout, or ``UnsupportedModelError`` naming what racer
    cannot verify: a layer with a recurrent or convolution state, a layer type or
    locality setting it does not know, per-layer windows the model cannot take
    separately."""
    config = text_config(model.config)
    kind = getattr(config, "model_type", "?")
    types, kwargs = _layer_types(config)
    for index, layer_type in enumerate(types or []):
        where = f"{kind} layer {index} ({layer_type!r})"
        if layer_type in _STATEFUL:
            raise UnsupportedModelError(
                f"{where} carries a recurrent, convolution or linear-attention state, which one pass over a "
                "branching tree would run every node through in turn; racer verifies attention layers only")
        if layer_type not in _ATTENTION and layer_type not in _NO_KV:
            raise UnsupportedModelError(f"{where}: racer does not know this layer type, so it cannot say which "
                                        "keys a tree node may see there")
    unread = _unread_locality(config)
    if unread:
        raise UnsupportedModelError(f"model type {kind!r} declares locality racer does not read: {', '.join(unread)}")
    if getattr(config, "attention_layers", None) is not None and getattr(config, "window_size", None) is not None:
        return _gpt_neo_layout(model, config)
    if types is None:  # transformers without layer types: one setting for every layer
        window = _uniform_window(config)
        return AttentionLayout((window,) * int(getattr(config, "num_hidden_layers", 1) or 1))
    windows, keyed = [], {}
    for index, (layer_type, arguments) in enumerate(zip(types, kwargs)):
        where = f"{kind} layer {index} ({layer_type!r})"
        if layer_type in _NO_KV:
            continue
        window = _window_of(_ATTENTION[layer_type], arguments.get("sliding_window"), where)
        if window.kind == SLIDING and getattr(config, "use_sliding_window", True) is False:
            window = Window()
        windows.append(window)
        if keyed.setdefault(layer_type, window) != window:
            raise UnsupportedModelError(f"{where}: layers of one type with different windows cannot share a mask")
    if not windows:
        raise UnsupportedModelError(f"model type {kind!r}: no attention layer to verify a tree with")
    distinct = set(windows)
    uses_types = getattr(config, "layer_types", None) is not None
    if len(distinct) > 1 and not uses_types:
        raise UnsupportedModelError(f"model type {kind!r} has layers with different windows but no layer_types "
                                    "to take a mask per layer by")
    return AttentionLayout(tuple(windows), keyed if uses_types and len(distinct) > 1 else None)


def _uniform_window(config: Any) -> Window:
    kind = getattr(config, "model_type", "?")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    chunk = getattr(config, "attention_chunk_size", None)
    if window and chunk:
        raise UnsupportedModelError(f"model type {kind!r} sets both sliding_window and attention_chunk_size "
                                    "without layer_types")
    if window and getattr(config, "max_window_layers", None) not in (None, 0):
        raise UnsupportedModelError(f"model type {kind!r}: max_window_layers gives layers different windows, "
                                    "which this transformers version's model cannot take as separate masks")
    if window:
        return _window_of(SLIDING, window, f"{kind} sliding_window")
    if chunk:
        return _window_of(CHUNKED, chunk, f"{kind} attention_chunk_size")
    return Window()


def _gpt_neo_layout(model: Any, config: Any) -> AttentionLayout:
    size = int(config.window_size)
    local = Window(SLIDING, size)
    windows = tuple(local if t == "local" else Window() for t in config.attention_layers)
    indexed, causal = [], {}
    for module in model.modules():
        bias = getattr(module, "bias", None)
        if getattr(module, "attention_type", None) == "local" and isinstance(bias, torch.Tensor) and bias.dim() == 4:
            key = (tuple(bias.shape), bias.device)
            if key not in causal:
                square = torch.ones(bias.shape[-2:], dtype=torch.bool, device=bias.device)
                causal[key] = torch.tril(square).view(bias.shape)
            indexed.append(IndexedWindow(module, local, causal[key]))
    if local in windows and not indexed:
        raise UnsupportedModelError(f"model type {getattr(config, 'model_type', '?')!r}: local attention layers "
                                    "without the causal buffer racer replaces for tree passes")
    return AttentionLayout(windows, None, tuple(indexed))
