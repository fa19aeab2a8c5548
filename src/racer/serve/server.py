"""Starting and stopping the server: the model, the decoder, the decoding thread and
uvicorn; SIGTERM (or Ctrl-C) stops accepting, lets streams in flight finish for up to
``grace`` seconds, ends the rest and exits."""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import Any, Callable

import racer
from racer.serve.app import MEMORY_SCOPES, Served, create_app
from racer.serve.engine import Engine
from racer.serve.metrics import Metrics


def serve(model_name: str | None = None, *, method: str = "racer", dtype: str = "float32", device: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, max_queue: int = 32,
          api_key: str | None = None, default_max_tokens: int = 1024, prefill_chunk: int = 512,
          grace: float = 10.0, memory_scope: str = "server", announce: Callable[[str], None] | None = None) -> None:
    """Serve ``model_name`` (default: the embedded model) with ``method`` until stopped."""
    import uvicorn

    say = announce or (lambda text: print(f"racer serve: {text}", file=sys.stderr, flush=True))
    for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("default_max_tokens", default_max_tokens),
                        ("prefill_chunk", prefill_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_queue" else 1):
            raise ValueError(f"{name}: expected a {'non-negative' if name == 'max_queue' else 'positive'} integer, "
                             f"got {value!r}")
    if memory_scope not in MEMORY_SCOPES:
        raise ValueError(f"memory_scope: expected one of {', '.join(MEMORY_SCOPES)}, got {memory_scope!r}")
    racer.parse_method(method)  # a bad spec fails before the model loads

    def build() -> racer.BatchDecoder:  # on the engine's thread: one OpenMP team (serve/engine.py)
        model, tokenizer = racer.load_model(model_name, dtype=dtype, device=device)
        decoder = racer.BatchDecoder(model, tokenizer, method, max_batch=max_batch, prefill_chunk=prefill_chunk)
        decoder.calibrate(announce=say)
        return decoder

    metrics = Metrics()
    engine = Engine(build, max_queue, on_step=metrics.step)
    decoder = engine.wait_ready()
    model, tokenizer = decoder.model, decoder.tokenizer
    name = model_name or racer.DEFAULT_MODEL
    context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    served = Served(engine, name, tokenizer, context, api_key, default_max_tokens, metrics, memory_scope, method)
    app = create_app(served)

    @asynccontextmanager
    async def lifespan(_: Any) -> Any:
        say(f"serving {name} with {method} on http://{host}:{port} (max batch {max_batch}, queue {max_queue}, "
            f"drafter memory per {memory_scope})")
        yield
        engine.stop(grace=0.0)  # uvicorn has already waited out the grace for open streams
        say("stopped")

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace,
                            access_log=False)
    uvicorn.Server(config).run()
