"""Starting and stopping the server: the tokenizer, the engine core's process (which
loads the model and decodes) and uvicorn; SIGTERM (or Ctrl-C) stops accepting, lets
streams in flight finish for up to ``grace`` seconds, ends the rest, stops the engine
and exits."""

from __future__ import annotations

import errno
import socket
import sys
from contextlib import asynccontextmanager
from typing import Any, Callable

import racer
from racer.serve.app import MAX_BODY, MEMORY_SCOPES, Served, create_app
from racer.serve.core import EngineSpec
from racer.serve.core_client import CoreClient
from racer.serve.metrics import Metrics


def serve(model_name: str | None = None, *, method: str = "racer", dtype: str = "float32", device: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, max_queue: int = 32,
          api_key: str | None = None, default_max_tokens: int = 1024, prefill_chunk: int = 2048,
          grace: float = 10.0, memory_scope: str = "server", max_body: int = MAX_BODY, threads: int | None = None,
          prefix_cache_mib: int = 512, announce: Callable[[str], None] | None = None) -> None:
    """Serve ``model_name`` (default: the embedded model) with ``method`` until stopped.
    The port is taken first, so that a busy one is said at once, not after the model
    has loaded; it accepts connections once the model is loaded and timed. ``threads``:
    torch's threads in the engine process (default: torch's). ``prefill_chunk``: the
    prompt tokens prefilled a step, of one or more waiting requests (the most a step
    delays the requests decoding; vLLM's OpenAI server takes 2048 a step on a CPU too).
    ``prefix_cache_mib``: the finished requests' KV kept for later prompts of the same
    memory scope that begin with the same tokens (0: none)."""
    import uvicorn

    say = announce or (lambda text: print(f"racer serve: {text}", file=sys.stderr, flush=True))
    for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("default_max_tokens", default_max_tokens),
                        ("prefill_chunk", prefill_chunk), ("max_body", max_body), ("prefix_cache_mib", prefix_cache_mib)):
        zero = name in ("max_queue", "prefix_cache_mib")
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
            raise ValueError(f"{name}: expected a {'non-negative' if zero else 'positive'} integer, got {value!r}")
    if memory_scope not in MEMORY_SCOPES:
        raise ValueError(f"memory_scope: expected one of {', '.join(MEMORY_SCOPES)}, got {memory_scope!r}")
    racer.parse_method(method)  # a bad spec fails before the model loads
    listener = bind(host, port)

    name = model_name or racer.DEFAULT_MODEL
    tokenizer = racer.load_tokenizer(model_name, announce=say)  # first: the embedded model is converted once
    metrics = Metrics()
    spec = EngineSpec(model_name, method, dtype, device, max_batch, prefill_chunk, threads, prefix_cache_mib)
    core = CoreClient.in_process(spec, max_queue, on_step=metrics.step)
    context = core.wait_ready().context
    served = Served(core, name, tokenizer, context, api_key, default_max_tokens, metrics, memory_scope, method,
                    max_body)
    app = create_app(served)

    @asynccontextmanager
    async def lifespan(_: Any) -> Any:
        say(f"serving {name} with {method} on http://{host}:{port} (max batch {max_batch}, queue {max_queue}, "
            f"drafter memory per {memory_scope})")
        yield
        core.stop(grace=0.0)  # uvicorn has already waited out the grace for open streams
        say("stopped")

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace,
                            access_log=False)
    uvicorn.Server(config).run(sockets=[listener])


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and not yet listening (connections are refused
    until uvicorn listens on it); a clear error when the address cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, OverflowError) as err:
        raise ValueError(f"--host: cannot listen on {host!r} ({err})") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as err:
        listener.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port: {host}:{port} is already in use (another server?); pick another with --port") \
                from None
        raise ValueError(f"--host/--port: cannot listen on {host}:{port} ({err.strerror or err})") from None
    return listener
