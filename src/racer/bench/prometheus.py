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


# racer's counters of seconds by part: also kept per part, as "<name>:<part>".
SECONDS_BY_PART = ("racer_engine_seconds_total", "racer_api_seconds_total")


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text: every ``racer_*_total`` and ``vllm:*_total`` counter, summed over
    its label sets (and racer's seconds also by part)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        if name.startswith(("racer_", "vllm:")) and name.endswith("_total"):
            try:
                number = float(value)
            except ValueError:
                continue
            out[name] = out.get(name, 0.0) + number
            if name in SECONDS_BY_PART and labels.startswith('part="'):
                key = f"{name}:{labels[6:].partition(chr(34))[0]}"
                out[key] = out.get(key, 0.0) + number
    return out


def seconds_by_part(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where a racer server's time went between two scrapes: ``engine.<part>`` and
    ``api.<part>`` seconds (empty for a server without these counters)."""
    out = {}
    for key, value in after.items():
        name, _, part = key.partition(":")
        if part and name in SECONDS_BY_PART:
            side = "engine" if name == SECONDS_BY_PART[0] else "api"
            out[f"{side}.{part}"] = value - before.get(key, 0.0)
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
