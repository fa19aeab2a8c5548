"""The HTTP side of ``racer serve``: OpenAI's routes on Starlette (through FastAPI),
served by uvicorn. Handlers check a request (``racer.serve.protocol``), hand its token
ids to the engine core (``racer.serve.core_client``) and answer from the events that
come back, whole or as server-sent events: detokenising, stop strings and JSON happen
here, never in the decoding loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from racer import Detokenizer, GenerationOptions, StopText, TokenSpans, chat_template_takes, encode_prompt
from racer.serve import protocol
from racer.serve.core_client import CoreClient, EngineGone, QueueFull
from racer.serve.events import Event, Failed, Finished, Tokens
from racer.serve.metrics import Metrics

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
PAGE = Path(__file__).resolve().parent / "static"  # the chat page: plain HTML, CSS and JS, nothing fetched elsewhere


MEMORY_SCOPES = ("request", "server", "user")
MAX_BODY = 4 << 20  # bytes of a request body; prompts are bounded by the context window as well
# The routes /metrics counts requests by; any other path is "other", so that probing
# URLs cannot grow the server's time series without bound.
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/static/{file}" if path.startswith("/static/") else "other"


class Served:
    """What the routes need: the engine core, the model's name and context, the tokenizer,
    and whose requests share drafter memory (``memory_scope``: ``request`` none,
    ``server`` all, ``user`` those with the same ``user`` field; without one, none);
    ``method``: the draft method, as ``/health`` tells the chat page."""

    def __init__(self, core: CoreClient, name: str, tokenizer: Any, context: int, api_key: str | None,
                 default_max_tokens: int, metrics: Metrics, memory_scope: str = "server", method: str = "",
                 max_body: int = MAX_BODY) -> None:
        if memory_scope not in MEMORY_SCOPES:
            raise ValueError(f"memory_scope: expected one of {', '.join(MEMORY_SCOPES)}, got {memory_scope!r}")
        self.core, self.name, self.tokenizer, self.context = core, name, tokenizer, context
        self.api_key, self.default_max_tokens, self.metrics = api_key, default_max_tokens, metrics
        self.memory_scope = memory_scope
        self.method = method
        self.max_body = max_body
        # Parsing, templating and tokenizing a request run here, off the event loop: a
        # large body must not hold up /health and the streams in flight.
        self.preparer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="racer-prepare")

    def scope(self, request: protocol.Request) -> Any:
        if self.memory_scope == "server":
            return "server"
        if self.memory_scope == "user" and request.user:
            return ("user", request.user)
        return None


def error_response(err: protocol.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Guard:
    """The API key on /v1/ routes, every answer counted by route and status, and a 500
    in OpenAI's error body for a bug (the server goes on). Plain ASGI, so that a
    handler reads its client's disconnect itself."""

    def __init__(self, app: Any, served: Served) -> None:
        self.app, self.served = app, served

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, served = scope["path"], self.served
        status = 500
        if served.api_key and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {served.api_key}":
                served.metrics.request(route_label(path), 401)
                return await error_response(protocol.ApiError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", kind="invalid_request_error"))(scope, receive, send)
        started = False

        async def sending(message: dict) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as err:  # noqa: BLE001 - a bug answers 500, the server goes on
            traceback.print_exc(file=sys.stderr)
            if not started:  # else the client already has its status; the stream just ends
                await error_response(protocol.ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                                       kind="server_error"))(scope, receive, send)
        finally:
            served.metrics.request(route_label(path), status)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="racer", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, served=served)

    @app.exception_handler(protocol.ApiError)
    async def api_error(request: HttpRequest, err: protocol.ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, err: HTTPException) -> JSONResponse:
        # Unknown routes, wrong methods, missing files: OpenAI's error body too.
        where = f"{request.method} {request.url.path}"
        message = {404: f"no such route or file: {where}",
                   405: f"method not allowed: {where} (allowed: {(err.headers or {}).get('Allow', '')})"}
        return error_response(protocol.ApiError(err.status_code, message.get(err.status_code, f"{where}: {err.detail}"),
                                                code="not_found" if err.status_code == 404 else None,
                                                headers=dict(err.headers or {})))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, "method": served.method, "in_flight": served.core.held,
                "api_key_required": bool(served.api_key)}

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
        return await complete(served, "chat", request)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        return await complete(served, "completion", request)

    return app


async def read_body(chunks: AsyncIterator[bytes], length: str | None, limit: int) -> bytes:
    """A request's body, refused with 413 past ``limit`` bytes: before reading when its
    Content-Length says so, else as soon as what arrived says so."""
    too_large = protocol.ApiError(413, f"the request body is larger than this server takes ({limit} bytes; "
                                       "racer serve --max-body sets it)", code="request_too_large")
    if length is not None:
        if not length.strip().isdigit():
            raise protocol.ApiError(400, f"Content-Length: expected a number of bytes, got {length!r}")
        if int(length) > limit:
            raise too_large
    body, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large
        body.append(chunk)
    return b"".join(body)


@dataclass
class Prepared:
    """A request checked and encoded: what the engine is handed."""

    request: protocol.Request
    ids: list[int]
    options: GenerationOptions


def prepare(served: Served, kind: str, raw: bytes) -> Prepared:
    """Parse, check, template and tokenize one request (on the preparer's threads)."""
    request = protocol.parse_request(kind, protocol.parse_json(raw), served.name)
    if request.tools and not chat_template_takes(served.tokenizer, "tools"):
        raise protocol.bad("tools", "this model's chat template does not take tools", code="unsupported_parameter")
    try:
        ids = encode_prompt(served.tokenizer, request.prompt, request.chat, tools=request.tools)
    except ValueError as err:
        raise protocol.bad("messages" if request.chat else "prompt", str(err)) from err
    return Prepared(request, ids, _options(served, request, len(ids)))


async def _client_gone(http: HttpRequest) -> None:
    """Returns when the client closes its connection (its body has been read, so the
    next message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _options(served: Served, request: protocol.Request, prompt_tokens: int) -> GenerationOptions:
    """The engine's options; the one check that the prompt and its answer fit the context."""
    room = served.context - prompt_tokens
    if room <= 0:
        raise protocol.ApiError(400, f"the prompt has {prompt_tokens} tokens; this model's context is {served.context}",
                                param="messages" if request.chat else "prompt", code="context_length_exceeded")
    if request.max_tokens is not None and request.max_tokens > room:
        raise protocol.ApiError(400, f"max_tokens: the prompt's {prompt_tokens} tokens and max_tokens="
                                f"{request.max_tokens} exceed the model's context of {served.context} tokens",
                                param="max_tokens", code="context_length_exceeded")
    limit = request.max_tokens if request.max_tokens is not None else min(served.default_max_tokens, room)
    # The engine stops right after the token that completes a stop string and leaves the
    # string out of its text, as OpenAI does.
    return GenerationOptions(max_new_tokens=max(limit, 1), stop=list(request.stop), temperature=request.temperature,
                             top_p=request.top_p, seed=request.seed)


def sink(loop: asyncio.AbstractEventLoop) -> tuple["asyncio.Queue[Event]", Any]:
    """A queue on ``loop``, and the function the core's reader calls to put an event in it."""
    box: "asyncio.Queue[Event]" = asyncio.Queue()

    def deliver(event: Event) -> None:
        loop.call_soon_threadsafe(box.put_nowait, event)

    return box, deliver


async def complete(served: Served, kind: str, http: HttpRequest) -> Any:
    raw = await read_body(http.stream(), http.headers.get("content-length"), served.max_body)
    loop = asyncio.get_running_loop()
    timed = time.perf_counter()
    prepared = await loop.run_in_executor(served.preparer, prepare, served, kind, raw)
    served.metrics.api("prepare", time.perf_counter() - timed)
    request, ids, options = prepared.request, prepared.ids, prepared.options
    box, deliver = sink(loop)
    try:
        key = served.core.submit(ids, options, deliver, served.scope(request))
    except QueueFull as err:
        raise protocol.ApiError(429, f"the server is busy: {err}; retry shortly", code="rate_limit_exceeded",
                                kind="rate_limit_error", headers={"Retry-After": "1"}) from err
    except EngineGone as err:
        raise protocol.ApiError(503, f"the server cannot decode: {err}", kind="server_error") from err
    started = time.perf_counter()
    if request.stream:
        return StreamingResponse(_stream(served, request, ids, box, key, started), media_type="text/event-stream")
    # A whole answer: the client may give up (a timeout) while it waits or decodes, and
    # then its row is freed at the next step rather than decoded to max_tokens.
    collecting, gone = asyncio.ensure_future(_collect(box)), asyncio.ensure_future(_client_gone(http))
    try:
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not collecting.done():
            served.core.cancel(key)
            collecting.cancel()
        gone.cancel()
    if not collecting.done() or collecting.cancelled():
        return Response(status_code=499)  # nobody is there to read it; counted as such in /metrics
    result = collecting.result()
    timed = time.perf_counter()
    if request.racer_stats:
        spans = TokenSpans.of(served.tokenizer, result)
        text = StopText(request.stop).add(spans.text, final=True)
        stats = _stats(result, spans.spans(0, len(text)))
    else:
        text = StopText(request.stop).add(served.tokenizer.decode(result.tokens, skip_special_tokens=True), final=True)
        stats = None
    result.text = text
    served.metrics.api("detokenize", time.perf_counter() - timed)
    served.metrics.finished(result, time.perf_counter() - started)
    return protocol.response(request, served.name, text, _FINISH.get(result.stop_reason, "stop"),
                             protocol.usage(len(ids), len(result.tokens), result.prompt_reused), stats)


def _ended(event: Event) -> Any:
    """A request's last event as its result, or the error it answers with."""
    if isinstance(event, Failed):
        raise protocol.ApiError(400 if event.refused else 500,
                                f"the request failed while decoding: {event.message}",
                                kind="invalid_request_error" if event.refused else "server_error")
    if event.result.stop_reason == "cancelled":
        raise protocol.ApiError(503, "the request was cancelled (the server is shutting down)", kind="server_error")
    return event.result


async def _collect(box: "asyncio.Queue[Event]") -> Any:
    """A whole request's result, once it is done (its tokens arrive with it)."""
    while True:
        event = await box.get()
        if isinstance(event, (Finished, Failed)):
            return _ended(event)


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


async def _stream(served: Served, request: protocol.Request, ids: list[int], box: "asyncio.Queue[Event]",
                  key: int, started: float) -> AsyncIterator[bytes]:
    """Chunks as tokens are accepted, their text decoded incrementally; text that might
    begin a stop string, or ends in part of a character, is held back until the next
    tokens decide it. With racer's extension each chunk also says which source drafted
    its text (runs ``[characters, source, step]``) and which steps (``[step, nodes
    verified, tokens, of which drafted]``) emitted tokens since the last chunk."""
    result = None
    spans = TokenSpans(served.tokenizer) if request.racer_stats else None
    text = spans if spans is not None else Detokenizer(served.tokenizer)
    visible = StopText(request.stop)
    passes: list[list[int]] = []
    metrics = served.metrics
    try:
        if request.kind == "chat":
            yield _sse(protocol.chunk(request, served.name, None, None, first=True))
        while result is None:
            event = await box.get()
            timed = time.perf_counter()
            if isinstance(event, Tokens):
                if spans is not None:
                    piece = spans.add(event.tokens, event.sources, event.step)
                    drafted = sum(source != "none" for source in event.sources)
                    passes.append([event.step, event.tree_size, len(event.tokens), drafted])
                else:
                    piece = text.add(event.tokens)
                shown = len(visible.shown)
                out = visible.add(piece)
            else:
                try:
                    result = _ended(event)
                except protocol.ApiError as err:
                    message = "the request was cancelled" if isinstance(event, Finished) else err.message
                    yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                    return
                shown = len(visible.shown)
                out = visible.add(text.finish(), final=True)
            metrics.api("detokenize", time.perf_counter() - timed)
            if out:
                timed = time.perf_counter()
                extension = None
                if spans is not None:
                    extension, passes = {"spans": spans.spans(shown, len(visible.shown)), "steps": passes}, []
                chunk = _sse(protocol.chunk(request, served.name, out, None, racer=extension))
                metrics.api("respond", time.perf_counter() - timed)
                yield chunk
        result.text = visible.shown
        finish = _FINISH.get(result.stop_reason, "stop")
        extension = {"spans": [], "steps": passes} if spans is not None else None
        yield _sse(protocol.chunk(request, served.name, None, finish, racer=extension))
        metrics.finished(result, time.perf_counter() - started)
        if request.include_usage:
            stats = _stats(result, spans.spans(0, len(result.text))) if spans is not None else None
            used = protocol.usage(len(ids), len(result.tokens), result.prompt_reused)
            yield _sse(protocol.usage_chunk(request, served.name, used, stats))
        yield b"data: [DONE]\n\n"
    finally:
        if result is None:  # the client went away (or the request failed): free its row
            served.core.cancel(key)
