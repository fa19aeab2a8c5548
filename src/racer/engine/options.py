"""What a caller asks of one generation: the prompt, limits, stops and sampling."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from racer.engine.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationOptions(SamplingParams):
    """Options of ``Decoder.generate`` and ``Decoder.stream``: the sampling parameters of
    ``SamplingParams`` (``temperature`` 0: greedy), and ``max_new_tokens``; ``stop``:
    strings that end generation right after the token completing one; ``chat``: apply
    the chat template to a text prompt; ``max_tree``: the most nodes verified per step."""

    max_new_tokens: int = 256
    stop: Sequence[str] | str | None = ()
    chat: bool = False
    max_tree: int = 1 << 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_new_tokens", "max_tree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        stop = self.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stops)

    @staticmethod
    def of(options: "GenerationOptions | None", overrides: dict[str, Any]) -> "GenerationOptions":
        """``options`` (default: the defaults) with the fields in ``overrides`` replaced."""
        fields = {f.name for f in dataclasses.fields(GenerationOptions)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unexpected option {', '.join(unknown)}; expected any of {', '.join(sorted(fields))}")
        if options is None:
            return GenerationOptions(**overrides)
        if not isinstance(options, GenerationOptions):
            raise ValueError(f"options: expected GenerationOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **overrides) if overrides else options


def encode_prompt(tokenizer: Any, prompt: Any, chat: bool) -> list[int]:
    """Token ids for a prompt given as text, chat messages, or ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt: expected non-empty text, got an empty string")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat: the tokenizer has no chat template; pass chat=False for raw text")
            prompt = [{"role": "user", "content": prompt}]
        else:
            return list(tokenizer(prompt, add_special_tokens=False).input_ids) or _empty()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if isinstance(prompt, (list, tuple, np.ndarray)) or hasattr(prompt, "tolist"):
        ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        return ids or _empty()
    raise ValueError(f"prompt: expected text, chat messages or token ids, got {type(prompt).__name__}")


def request_ids(tokenizer: Any, prompt: Any, options: GenerationOptions, context: int) -> list[int]:
    """A request's prompt as token ids (``encode_prompt``), checked against the options
    and a context window of ``context`` positions."""
    if options.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer")
    ids = encode_prompt(tokenizer, prompt, options.chat)
    if len(ids) >= context:
        raise ValueError(f"prompt: {len(ids)} tokens do not fit the model's context window of {context} tokens "
                         "(one position is needed for the first new token)")
    return ids


def _empty() -> list[int]:
    raise ValueError("prompt: expected at least one token, got none")
