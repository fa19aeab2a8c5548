"""What the engine needs to know of a loaded model, worked out in one place: where its
weights live and in which dtype, how many positions it takes, its vocabulary (through
the text config, so that multimodal configs work), the end-of-sequence ids its configs
name, and the keywords its ``forward`` takes for the KV cache and for logits of the
last positions only. The engine works them out once and hands them to every verifier
it makes, with its support check's attention layout (``racer.engine.support``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

UNBOUNDED = 1 << 30  # positions of a model whose config names no limit


def text_config(config: Any) -> Any:
    """The config of the model's text decoder (the config itself for a text model)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # transformers versions whose get_text_config takes no argument
        return get()


@dataclass(frozen=True)
class ModelFacts:
    device: torch.device
    dtype: torch.dtype
    max_positions: int  # the context window: prompt and new tokens together
    vocab_size: int
    cache_keyword: str  # "cache" (transformers 5) or "past_key_values" (4.x)
    logits_keyword: str | None  # "logits_to_keep", "num_logits_to_keep", or None where forward takes neither
    end_ids: frozenset[int] = frozenset()  # eos ids of the generation config and the config

    @staticmethod
    def of(model: Any) -> "ModelFacts":
        weight = next(model.parameters())
        config, text = model.config, text_config(model.config)
        positions = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        ends: set[int] = set()
        for source in (getattr(model, "generation_config", None), config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ends.update([eos] if isinstance(eos, int) else eos)
        return ModelFacts(weight.device, weight.dtype, int(positions or UNBOUNDED),
                          int(getattr(text, "vocab_size", None) or config.vocab_size),
                          "cache" if "cache" in params else "past_key_values", keep, frozenset(ends))
