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
    tools: list[dict] | None = None  # for the chat template; calls come back as text
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# Fields each endpoint takes; "unsupported" ones get a 400 naming them unless given at
# their neutral value (OpenAI's clients send some of them as null or defaults).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
           "user", "racer"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"}
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


def _text(value: Any, where: str, nullable: bool = False) -> str | None:
    """A message's content: a string or text parts (joined); None only where ``nullable``."""
    if value is None and nullable:
        return None
    if isinstance(value, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in value):
            raise bad(where, "only text content parts are supported")
        return "".join(p["text"] for p in value)
    if not isinstance(value, str):
        expected = "a string or null (with tool_calls)" if nullable else "a string"
        raise bad(where, f"expected {expected}, got {type(value).__name__ if value is not None else 'null'}")
    return value


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates take them: each call's
    ``arguments`` (OpenAI sends a JSON string) parsed into an object where it is one."""
    if not isinstance(value, list):
        raise bad(where, f"expected a list of tool calls, got {type(value).__name__}")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"{at}.function", "expected an object with the function's name and arguments")
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", f"expected 'function', got {call.get('type')!r}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                parsed = arguments  # the model's own malformed call, sent back as it was
            arguments = parsed
        out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_FIELDS = {"system": {"name"}, "developer": {"name"}, "user": {"name"},
                   "assistant": {"name", "tool_calls", "refusal"}, "tool": {"tool_call_id", "name"}}


def _messages(value: Any) -> list[dict]:
    """Chat messages, agent turns included: ``tool`` results and assistant turns that
    called tools (``content`` null with ``tool_calls``)."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(where, f"expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            hint = " (function messages are tool messages now)" if role == "function" else ""
            raise bad(f"{where}.role", f"expected {', '.join(_ROLES[:-1])} or tool, got {role!r}{hint}")
        extra = set(message) - {"role", "content"} - _MESSAGE_FIELDS[role]
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", f"not supported in a {role} message")
        calls = message.get("tool_calls")
        content = _text(message.get("content"), f"{where}.content", nullable=role == "assistant")
        entry: dict = {"role": "system" if role == "developer" else role, "content": content or ""}
        if calls is not None:
            entry["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        elif content is None:
            raise bad(f"{where}.content", "expected a string (null only beside tool_calls)")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.tool_call_id", "expected the id of the tool call this message answers")
            entry["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def _tools(body: dict) -> list[dict] | None:
    """``tools`` for the chat template (None: none offered, or ``tool_choice`` "none").
    Tool calls come back as the model's text: racer parses none, so it cannot force one."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad("tool_choice", "expected 'auto' or 'none': tool calls are returned as the model's text, so "
                                 "racer cannot force one", code="unsupported_parameter")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"expected true or false, got {parallel!r}")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"expected a list of tools, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"tools[{index}].type", "expected a tool of type 'function'")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{index}].function", "expected an object with the function's name (and parameters)")
    return None if choice == "none" else [dict(tool) for tool in tools]


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
    tools = _tools(body) if kind == "chat" else None
    return Request(kind, prompt, chat, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                   _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), seed, stops, bool(stream),
                   include_usage, extras, user, tools)


def draft_counts(steps: list) -> dict:
    """Draft tokens proposed, verified and accepted over a request's steps
    (``racer.StepStats``)."""
    return {"draft_tokens_proposed": sum(max(s.candidates - 1, 0) for s in steps),
            "draft_tokens_verified": sum(s.tree_size - 1 for s in steps),
            "draft_tokens_accepted": sum(s.accepted for s in steps)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: leading prompt tokens whose KV a kept
    prefix gave (``prompt_tokens_details``, as OpenAI reports prompt caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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
