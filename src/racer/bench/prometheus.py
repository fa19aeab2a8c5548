"""Reading a server's ``/metrics`` (Prometheus' text format) into counters, and the
per-pass figures worked out from two readings: racer's and vLLM's alike."""

from __future__ import annotations

import http.client


def counters(port: int) -> dict[str, float]:
    """A racer or vLLM server's Prometheus counters, each summed over its labels (empty
    for a server without /metrics)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode() if response.status == 200 else ""
    except OSError:
        return {}
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text: every ``racer_*_total`` and ``vllm:*_total`` counter, summed over
    its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0]
        if name.startswith(("racer_", "vllm:")) and name.endswith("_total"):
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
    return out


def nodes_per_pass(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Verified nodes (root included) per request per pass between two scrapes."""
    key, verified = "racer_verification_passes_total", "racer_draft_tokens_verified_total"
    if key not in after or key not in before:
        return None
    passes = after[key] - before[key]
    return 1 + (after[verified] - before[verified]) / passes if passes > 0 else None


def tokens_per_pass(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None]:
    """Between two scrapes: tokens emitted per request per target pass (every pass emits
    its accepted drafts and one token of the model's own, so passes are tokens minus
    accepted drafts), and vLLM's mean acceptance length (1 + accepted / drafts: steps
    that drafted nothing do not count there)."""
    for tokens, accepted in (("racer_completion_tokens_total", "racer_draft_tokens_accepted_total"),
                             ("vllm:generation_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")):
        if tokens in after:
            emitted = after[tokens] - before.get(tokens, 0.0)
            taken = after.get(accepted, 0.0) - before.get(accepted, 0.0)
            per_pass = emitted / (emitted - taken) if emitted > taken else None
            drafts = after.get("vllm:spec_decode_num_drafts_total", 0.0) - before.get(
                "vllm:spec_decode_num_drafts_total", 0.0)
            return per_pass, (1 + taken / drafts if drafts > 0 else None)
    return None, None
