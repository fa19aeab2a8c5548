"""``/metrics`` in Prometheus' text format (``prometheus_client``), one registry per server."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from racer.serve.protocol import draft_counts


class Metrics:
    """Requests by route and status, queue length and batch size, completion tokens,
    prompt tokens and those a kept prefix gave, passes and draft tokens proposed,
    verified and accepted (tokens/s and MAT are their rates and ratios), request latency, and where the time goes: the engine's seconds by
    part (``racer.serve.events.Stepped``) and the API side's (``prepare``: parsing,
    templating, tokenizing; ``detokenize``: text and stop strings; ``respond``: the
    chunks' JSON)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("racer_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.queue = Gauge("racer_queue_length", "requests waiting for a batch row", registry=r)
        self.batch = Gauge("racer_batch_size", "requests decoding in the batch", registry=r)
        self.idle = Gauge("racer_idle_drafters", "drafters kept for later requests of their memory scope",
                          registry=r)
        self.tokens = Counter("racer_completion_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("racer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("racer_prompt_tokens_cached",
                                     "prompt tokens whose KV a kept prefix gave (not prefilled)", registry=r)
        self.passes = Counter("racer_verification_passes", "verification passes, summed over requests",
                              registry=r)
        self.proposed = Counter("racer_draft_tokens_proposed", "draft tokens the drafters proposed", registry=r)
        self.verified = Counter("racer_draft_tokens_verified", "draft tokens verified", registry=r)
        self.accepted = Counter("racer_draft_tokens_accepted", "draft tokens accepted", registry=r)
        self.latency = Histogram("racer_request_seconds", "request latency", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120))
        self.engine_seconds = Counter("racer_engine_seconds", "the engine core's time, by part", ["part"], registry=r)
        self.api_seconds = Counter("racer_api_seconds", "the API side's time on requests, by part", ["part"],
                                   registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def step(self, step: Any) -> None:
        """A ``Stepped`` event."""
        self.batch.set(step.active)
        self.queue.set(step.waiting)
        self.idle.set(step.idle_drafters)
        for part, seconds in step.seconds.items():
            self.engine_seconds.labels(part=part).inc(max(seconds, 0.0))

    def api(self, part: str, seconds: float) -> None:
        self.api_seconds.labels(part=part).inc(seconds)

    def finished(self, result: Any, seconds: float) -> None:
        self.tokens.inc(len(result.tokens))
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(result.prompt_reused)
        self.passes.inc(result.passes)
        counts = draft_counts(result.steps)
        self.proposed.inc(counts["draft_tokens_proposed"])
        self.verified.inc(counts["draft_tokens_verified"])
        self.accepted.inc(counts["draft_tokens_accepted"])
        self.latency.observe(seconds)

    def render(self) -> tuple[str, str]:
        return generate_latest(self.registry).decode(), CONTENT_TYPE_LATEST
