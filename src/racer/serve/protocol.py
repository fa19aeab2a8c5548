"""The OpenAI API as racer serves it: requests checked field by field into what the
engine takes, responses and stream chunks in OpenAI's shapes, errors in its body.

Pure Python: no torch, no HTTP framework.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOPS = 4


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclass
class Request:
    """A checked request: ``prompt`` (chat messages or text or token ids) and the
    options the engine takes."""

    kind: str  # "chat" or "completion"
    prompt: Any
    chat: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    racer_stats: bool
    user: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# Fields each endpoint takes; "unsupported" ones get a 400 naming them unless given at
# their neutral value (OpenAI's clients send some of them as null or defaults).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
           "user", "racer"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION = _COMMON | {"prompt"}
_NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
            "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
            "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
            "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,), "echo": (None, False),
            "suffix": (None, ""), "best_of": (None, 1), "service_tier": (None, "auto", "default"),
            "store": (None, False), "metadata": (None, {}), "modalities": (None, ["text"]),
            "prediction": (None,), "audio": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from err
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"expected a number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad(name, f"expected a number in {bracket}{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r}")
    if value < low:
        raise bad(name, f"expected an integer of at least {low}, got {value}")
    return value


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(where, f"expected an object with role and content, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}.role", f"expected system, developer, user or assistant, got {role!r}")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"expected a string, got {type(content).__name__}")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", "not supported")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(value: Any) -> tuple[Any, bool]:
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "expected non-empty text")
        return value, False
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return _prompt(value[0])
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return list(value), False
    if isinstance(value, list) and len(value) > 1:
        raise bad("prompt", "one prompt per request (batch several requests instead)")
    raise bad("prompt", f"expected text or a list of token ids, got {value!r}")


def parse_request(kind: str, body: dict, served: str) -> Request:
    """``body`` checked as an OpenAI chat or completion request to the model ``served``."""
    known = _CHAT if kind == "chat" else _COMPLETION
    for name, value in body.items():
        if name in known:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name]:
            continue
        if name in _NEUTRAL:
            raise bad(name, "not supported by this server", code="unsupported_parameter")
        raise bad(name, "unknown parameter", code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "expected the name of the served model")
    if model != served:
        raise ApiError(404, f"model: {model!r} is not served here (this server serves {served!r})",
                       param="model", code="model_not_found")
    if kind == "chat":
        prompt, chat = _messages(body.get("messages")), True
    else:
        if "prompt" not in body:
            raise bad("prompt", "required")
        prompt, chat = _prompt(body["prompt"])
    max_tokens = _integer(body, "max_completion_tokens", 1) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise bad("n", f"only n=1 is supported, got {n}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise bad("seed", f"expected a non-negative integer, got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", f"expected a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad("stop", f"expected at most {MAX_STOPS} non-empty strings")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"expected true or false, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", "expected an object with include_usage only")
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        include_usage = bool(options.get("include_usage", False))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"expected a string, got {type(user).__name__}")
    extras = body.get("racer", False)
    if not isinstance(extras, bool):
        raise bad("racer", f"expected true or false (add racer's statistics and each token's draft source to the "
                           f"response), got {extras!r}")
    return Request(kind, prompt, chat, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                   _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), seed, stops, bool(stream),
                   include_usage, extras, user)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (OpenAI leaves it out), and whether one was found."""
    found = [text.find(s) for s in stops if s in text]
    return (text[: min(found)], True) if found else (text, False)


def draft_counts(steps: list) -> dict:
    """Draft tokens proposed, verified and accepted over a request's steps
    (``racer.StepStats``)."""
    return {"draft_tokens_proposed": sum(max(s.candidates - 1, 0) for s in steps),
            "draft_tokens_verified": sum(s.tree_size - 1 for s in steps),
            "draft_tokens_accepted": sum(s.accepted for s in steps)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: Request, served: str, text: str, finish: str, used: dict, stats: dict | None) -> dict:
    if request.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        out = {"id": f"chatcmpl-{request.id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        out = {"id": f"cmpl-{request.id}", "object": "text_completion"}
    out.update(created=request.created, model=served, choices=[choice], usage=used)
    if stats is not None:
        out["racer"] = stats
    return out


def chunk(request: Request, served: str, text: str | None, finish: str | None, first: bool = False,
          racer: dict | None = None) -> dict:
    if request.kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        out = {"id": f"chatcmpl-{request.id}", "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        out = {"id": f"cmpl-{request.id}", "object": "text_completion"}
    out.update(created=request.created, model=served, choices=[choice])
    if racer is not None:
        out["racer"] = racer
    return out


def usage_chunk(request: Request, served: str, used: dict, stats: dict | None) -> dict:
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
    out = {"id": f"{prefix}-{request.id}", "object": kind, "created": request.created, "model": served,
           "choices": [], "usage": used}
    if stats is not None:
        out["racer"] = stats
    return out
