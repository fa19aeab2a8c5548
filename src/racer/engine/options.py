"""What a caller asks of one generation: the prompt, limits, stops and sampling."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from racer.engine.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationOptions(SamplingParams):
    """Options of ``Decoder.generate`` and ``Decoder.stream``: the sampling parameters of
    ``SamplingParams`` (``temperature`` 0: greedy), and ``max_new_tokens``; ``stop``:
    strings that end generation right after the token completing one (the text leaves
    the stop string out); ``chat``: whether a text prompt is a user message put through
    the chat template (None, the default: when the tokenizer has one; False: raw text);
    ``max_tree``: the most nodes verified per step; ``end_ids``: the tokens that end
    generation (None, the default: the model's and the tokenizer's end-of-sequence ids;
    empty: none, it runs to ``max_new_tokens``)."""

    max_new_tokens: int = 256
    stop: Sequence[str] | str | None = ()
    chat: bool | None = None
    max_tree: int = 1 << 16
    end_ids: Sequence[int] | None = None

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
        if self.end_ids is not None:
            ends = self.end_ids
            if isinstance(ends, (str, bytes)) or not hasattr(ends, "__iter__") or any(
                    isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in ends):
                raise ValueError(f"end_ids: expected token ids (non-negative integers) or None, got {ends!r}")
            object.__setattr__(self, "end_ids", tuple(int(t) for t in ends))
        if self.chat not in (None, True, False):
            raise ValueError(f"chat: expected True, False or None (the chat template when there is one), "
                             f"got {self.chat!r}")

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


def has_chat_template(tokenizer: Any) -> bool:
    return bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))


@functools.lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str] | None:
    """The variables a chat template reads (parsed once per template), or None where
    Jinja cannot parse it alone (tags of transformers' own)."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(source)))
    except TemplateSyntaxError:
        return None


def chat_template_takes(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's chat template reads the variable ``name`` (``tools``)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    sources = list(template.values()) if isinstance(template, dict) else [template] if template else []
    for source in sources:
        variables = _template_variables(source)
        if name in (variables if variables is not None else source):
            return True
    return False


def _calls_as_text(messages: list[dict]) -> list[dict]:
    """Assistant turns that called tools, for a template that knows no ``tool_calls``:
    the calls written into the content as JSON lines, so the model still reads what it
    called."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            lines = [json.dumps({"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})},
                                ensure_ascii=False) for c in calls]
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *lines]))
        out.append(message)
    return out


def encode_prompt(tokenizer: Any, prompt: Any, chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids for a prompt given as text, chat messages, or ids. Text is a user
    message put through the chat template when ``chat`` is True, or None and the
    tokenizer has a template; raw text otherwise. Messages always go through the
    template, with ``tools`` where given (a template that does not read them refuses)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt: expected non-empty text, got an empty string")
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer; pass token ids")
        if chat is None:
            chat = has_chat_template(tokenizer)
        if chat:
            if not has_chat_template(tokenizer):
                raise ValueError("chat: the tokenizer has no chat template; pass chat=False for raw text")
            prompt = [{"role": "user", "content": prompt}]
        else:
            return list(tokenizer(prompt, add_special_tokens=False).input_ids) or _empty()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if not has_chat_template(tokenizer):
            raise ValueError("messages: the tokenizer has no chat template; pass raw text with chat=False, or ids")
        if tools and not chat_template_takes(tokenizer, "tools"):
            raise ValueError("tools: this model's chat template does not take tools")
        messages = list(prompt)
        if any(m.get("tool_calls") for m in messages) and "tool_calls" not in str(tokenizer.chat_template):
            messages = _calls_as_text(messages)
        from jinja2 import TemplateError

        try:
            ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                tokenize=True)
        except TemplateError as err:
            raise ValueError(f"messages: the model's chat template refused them: {err}") from None
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
