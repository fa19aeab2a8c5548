"""The HTTP side of ``racer serve``: OpenAI's routes on Starlette (through FastAPI),
served by uvicorn. Handlers check a request (``racer.serve.protocol``), hand it to the
decoding thread (``racer.serve.engine``) and answer from what comes back, whole or as
server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from racer import GenerationOptions, TokenSpans, encode_prompt
from racer.serve import protocol
from racer.serve.engine import Engine, QueueFull, asyncio_sink
from racer.serve.metrics import Metrics

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
PAGE = Path(__file__).resolve().parent / "static"  # the chat page: plain HTML, CSS and JS, nothing fetched elsewhere


MEMORY_SCOPES = ("request", "server", "user")


class Served:
    """What the routes need: the engine, the model's name and context, the tokenizer,
    and whose requests share drafter memory (``memory_scope``: ``request`` none,
    ``server`` all, ``user`` those with the same ``user`` field; without one, none);
    ``method``: the draft method, as ``/health`` tells the chat page."""

    def __init__(self, engine: Engine, name: str, tokenizer: Any, context: int, api_key: str | None,
                 default_max_tokens: int, metrics: Metrics, memory_scope: str = "server", method: str = "") -> None:
        if memory_scope not in MEMORY_SCOPES:
            raise ValueError(f"memory_scope: expected one of {', '.join(MEMORY_SCOPES)}, got {memory_scope!r}")
        self.engine, self.name, self.tokenizer, self.context = engine, name, tokenizer, context
        self.api_key, self.default_max_tokens, self.metrics = api_key, default_max_tokens, metrics
        self.memory_scope = memory_scope
        self.method = method

    def scope(self, request: protocol.Request) -> Any:
        if self.memory_scope == "server":
            return "server"
        if self.memory_scope == "user" and request.user:
            return ("user", request.user)
        return None


def error_response(err: protocol.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="racer", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next: Any) -> Any:
        path = request.url.path
        if served.api_key and path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if given != f"Bearer {served.api_key}":
                served.metrics.request(path, 401)
                return error_response(protocol.ApiError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", kind="invalid_request_error"))
        try:
            response = await call_next(request)
        except Exception as err:  # noqa: BLE001 - a bug answers 500, the server goes on
            served.metrics.request(path, 500)
            return error_response(protocol.ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                                    kind="server_error"))
        served.metrics.request(path, response.status_code)
        return response

    @app.exception_handler(protocol.ApiError)
    async def api_error(request: HttpRequest, err: protocol.ApiError) -> JSONResponse:
        return error_response(err)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, "method": served.method, "in_flight": served.engine.held}

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(PAGE / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=PAGE), name="static")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text, kind = served.metrics.render()
        return PlainTextResponse(text, media_type=kind)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "racer"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Any:
        return await complete(served, "chat", await request.body())

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        return await complete(served, "completion", await request.body())

    return app


def _options(served: Served, request: protocol.Request, prompt_tokens: int) -> GenerationOptions:
    room = served.context - prompt_tokens
    if request.max_tokens is not None and request.max_tokens > room:
        raise protocol.ApiError(400, f"max_tokens: the prompt's {prompt_tokens} tokens and max_tokens="
                                f"{request.max_tokens} exceed the model's context of {served.context} tokens",
                                param="max_tokens", code="context_length_exceeded")
    limit = request.max_tokens if request.max_tokens is not None else min(served.default_max_tokens, room)
    # Stop strings are cut by the server (OpenAI leaves them out of the text); the
    # engine stops right after the token that completes one.
    return GenerationOptions(max_new_tokens=max(limit, 1), stop=list(request.stop), temperature=request.temperature,
                             top_p=request.top_p, seed=request.seed)


async def complete(served: Served, kind: str, raw: bytes) -> Any:
    request = protocol.parse_request(kind, protocol.parse_json(raw), served.name)
    try:
        ids = encode_prompt(served.tokenizer, request.prompt, request.chat)
    except ValueError as err:
        raise protocol.bad("messages" if request.chat else "prompt", str(err)) from err
    if len(ids) >= served.context:
        raise protocol.ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {served.context}",
                                param="messages" if request.chat else "prompt", code="context_length_exceeded")
    options = _options(served, request, len(ids))
    box, deliver = asyncio_sink(asyncio.get_running_loop())
    try:
        ticket = served.engine.submit(ids, options, deliver, served.scope(request))
    except QueueFull as err:
        raise protocol.ApiError(429, f"the server is busy: {err}; retry shortly", code="rate_limit_exceeded",
                                kind="rate_limit_error", headers={"Retry-After": "1"}) from err
    started = time.perf_counter()
    if request.stream:
        return StreamingResponse(_stream(served, request, ids, box, ticket, started), media_type="text/event-stream")
    try:
        tokens, result = await _collect(box)
    except asyncio.CancelledError:
        served.engine.cancel(ticket)
        raise
    text = served.tokenizer.decode(tokens, skip_special_tokens=True)
    text, stopped = protocol.cut_at_stop(text, request.stop)
    finish = "stop" if stopped else _FINISH.get(result.stop_reason, "stop")
    served.metrics.finished(result, time.perf_counter() - started)
    stats = _stats(result, TokenSpans.of(served.tokenizer, result).spans(0, len(text))) if request.racer_stats else None
    return protocol.response(request, served.name, text, finish, protocol.usage(len(ids), len(result.tokens)), stats)


async def _collect(box: "asyncio.Queue[tuple]") -> tuple[list[int], Any]:
    tokens: list[int] = []
    while True:
        what, value = await box.get()
        if what == "tokens":
            tokens.extend(value.tokens)
        elif what == "done":
            return value.tokens, value
        elif what == "error":
            raise protocol.ApiError(500, f"the request failed while decoding: {type(value).__name__}: {value}",
                                    kind="server_error")
        else:
            raise protocol.ApiError(503, "the request was cancelled (the server is shutting down)",
                                    kind="server_error")


def _stats(result: Any, spans: list | None) -> dict:
    """racer's extension of a response: the request's statistics, each completion
    token's provenance counts and, as runs over the returned text, which source
    drafted what: ``[characters, source, step]``
    (``racer.TokenSpans``)."""
    stats = {"mat": round(result.mat, 3), "passes": result.passes, **protocol.draft_counts(result.steps),
             "stop_reason": result.stop_reason, "completion_token_ids": list(result.tokens),
             "provenance": result.provenance, "tree_sizes": [s.tree_size for s in result.steps]}
    if spans is not None:
        stats["spans"] = spans
    return stats


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _stream(served: Served, request: protocol.Request, ids: list[int], box: "asyncio.Queue[tuple]",
                  ticket: Any, started: float) -> AsyncIterator[bytes]:
    """Chunks as tokens are accepted; text that might begin a stop string, or end in part
    of a character, is held back until the next tokens decide it. With racer's
    extension each chunk also says which source drafted its text (runs ``[characters,
    source, step]``) and which steps (``[step, nodes verified, tokens, of
    which drafted]``) emitted tokens since the last chunk."""
    hold = max((len(s) for s in request.stop), default=1) - 1
    tokens: list[int] = []
    shown = ""
    result = None
    spans = TokenSpans(served.tokenizer) if request.racer_stats else None
    passes: list[list[int]] = []
    try:
        if request.kind == "chat":
            yield _sse(protocol.chunk(request, served.name, None, None, first=True))
        while result is None:
            what, value = await box.get()
            if what == "tokens":
                tokens.extend(value.tokens)
                if spans is not None:
                    spans.add(value.tokens, value.sources, value.step)
                    drafted = sum(source != "none" for source in value.sources)
                    passes.append([value.step, value.tree_size, len(value.tokens), drafted])
            elif what == "done":
                result = value
                tokens = list(value.tokens)
            else:
                message = "the request failed while decoding" if what == "error" else "the request was cancelled"
                yield _sse({"error": {"message": f"{message}: {value}", "type": "server_error", "param": None,
                                      "code": None}})
                return
            # The spans decode the same tokens already: one decoding an update, not two.
            text = spans.text if spans is not None else served.tokenizer.decode(tokens, skip_special_tokens=True)
            text, stopped = protocol.cut_at_stop(text, request.stop)
            if result is None and not stopped:
                text = text[:-1] if text.endswith("\ufffd") else text
                text = text[: max(len(text) - hold, len(shown))] if hold else text
            if len(text) > len(shown) and text.startswith(shown):
                extension = None
                if spans is not None:
                    extension, passes = {"spans": spans.spans(len(shown), len(text)), "steps": passes}, []
                yield _sse(protocol.chunk(request, served.name, text[len(shown):], None, racer=extension))
                shown = text
        final = protocol.cut_at_stop(served.tokenizer.decode(tokens, skip_special_tokens=True), request.stop)
        finish = "stop" if final[1] else _FINISH.get(result.stop_reason, "stop")
        extension = {"spans": [], "steps": passes} if spans is not None else None
        yield _sse(protocol.chunk(request, served.name, None, finish, racer=extension))
        served.metrics.finished(result, time.perf_counter() - started)
        if request.include_usage:
            stats = _stats(result, spans.spans(0, len(final[0]))) if spans is not None else None
            yield _sse(protocol.usage_chunk(request, served.name, protocol.usage(len(ids), len(result.tokens)), stats))
        yield b"data: [DONE]\n\n"
    finally:
        if result is None:  # the client went away (or the request failed): free its row
            served.engine.cancel(ticket)
