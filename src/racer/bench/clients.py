"""``racer bench-serve``'s clients: C concurrent clients each send their share of the
prompts, one after another, as streamed greedy chat completions over HTTP (the standard
library's client), and each answer's text, tokens, time to first token and latency are
kept; a load's completion tokens per second and percentiles are worked out from them.
A session (an agent's calls, each resending the conversation so far) goes to one client,
its requests in order."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

Prompt = Union[str, list]  # a user message, or the chat messages of one request


@dataclass(frozen=True)
class Session:
    """Requests one client sends one after another, as an agent does."""

    requests: tuple[Prompt, ...]


@dataclass
class Outcome:
    """One request as a client saw it."""

    ttft: float  # seconds to the first content
    latency: float  # seconds to the end of the answer
    tokens: int  # completion tokens (the server's usage, else counted from the text)
    text: str
    error: str | None = None


@dataclass
class Load:
    """One server under C clients."""

    server: str
    concurrency: int
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    rate: float | None = None  # set on merged rounds: the median round's throughput
    nodes: float | None = None  # verified nodes per request per pass (a racer server's /metrics)
    per_pass: float | None = None  # tokens emitted per request per target pass (/metrics of racer or vLLM)
    accepted_length: float | None = None  # vLLM's mean acceptance length: 1 + accepted / drafts
    seconds_by_part: dict[str, float] = field(default_factory=dict)  # a racer server's (bench.prometheus)

    @property
    def tokens_per_s(self) -> float:
        if self.rate is not None:
            return self.rate
        return sum(o.tokens for o in self.outcomes if o.error is None) / self.seconds

    def percentile(self, what: str, q: float) -> float:
        values = sorted(getattr(o, what) for o in self.outcomes if o.error is None)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    @property
    def errors(self) -> int:
        return sum(o.error is not None for o in self.outcomes)


def stream_chat(host: str, port: int, model: str, prompt: Prompt, max_tokens: int, count: Any = None,
                timeout: float = 600.0) -> Outcome:
    """One streamed, greedy chat completion; ``count(text)`` counts tokens when the
    server reports no usage."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    first, parts, tokens = None, [], None
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return Outcome(0.0, time.perf_counter() - start, 0, "", f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:  # server-sent events, a line at a time
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                return Outcome(0.0, time.perf_counter() - start, 0, "", str(event["error"]))
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter()
                    parts.append(piece)
            if event.get("usage"):
                tokens = int(event["usage"].get("completion_tokens") or 0)
    except (OSError, http.client.HTTPException, ValueError) as err:
        return Outcome(0.0, time.perf_counter() - start, 0, "".join(parts), f"{type(err).__name__}: {err}")
    finally:
        connection.close()
    end = time.perf_counter()
    text = "".join(parts)
    if tokens is None:
        tokens = count(text) if count is not None else 0
    return Outcome((first or end) - start, end - start, tokens, text)


def run_load(server: str, host: str, port: int, model: str, prompts: Sequence[Prompt | Session],
             concurrency: int, max_tokens: int, count: Any = None) -> Load:
    """``concurrency`` clients; client i sends prompts i, i + C, i + 2C, ... in turn (a
    session's requests one after another); the outcomes in the prompts' order."""
    outcomes: list[list[Outcome]] = [[] for _ in prompts]

    def client(index: int) -> None:
        for k in range(index, len(prompts), concurrency):
            requests = prompts[k].requests if isinstance(prompts[k], Session) else (prompts[k],)
            for request in requests:
                outcomes[k].append(stream_chat(host, port, model, request, max_tokens, count))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Load(server, concurrency, time.perf_counter() - start, [o for done in outcomes for o in done])


WORKLOADS = ("mix", "code_edit", "agent")


def _by_category_in_turn(dataset: str) -> list[str]:
    from racer.bench.questions import load_questions

    by_category: dict[str, list[str]] = {}
    for question in load_questions(dataset):
        by_category.setdefault(question.category, []).append(question.prompt)
    return [group[i] for i in range(max(map(len, by_category.values())))
            for group in by_category.values() if i < len(group)]


def prompt_pool(workload: str = "mix") -> list[Prompt | Session]:
    """The prompts clients send, in order. ``mix``: Spec-Bench (a question of each
    category in turn) and HumanEval, alternating; ``code_edit``: the code-editing
    requests (a task of each kind in turn), whose answers rewrite the code they carry;
    ``agent``: the agent sessions, each a ``Session`` of the calls that resend its
    growing conversation."""
    if workload not in WORKLOADS:
        raise ValueError(f"--workload: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    if workload == "agent":
        from racer.bench.questions import load_questions

        sessions: dict[str, list[Prompt]] = {}
        for question in load_questions("agent_sessions"):
            sessions.setdefault(question.session or question.question_id, []).append(question.chat)
        return [Session(tuple(requests)) for requests in sessions.values()]
    if workload == "code_edit":
        return _by_category_in_turn("code_edit")
    spec = _by_category_in_turn("spec_bench")
    code = _by_category_in_turn("human_eval")  # one category: the file's order
    return [prompt for pair in zip(spec, code) for prompt in pair]


def merge_rounds(loads: Sequence[Load]) -> list[Load]:
    """One load per (server, C): every round's outcomes, the median round's throughput."""
    merged = []
    for key in dict.fromkeys((l.server, l.concurrency) for l in loads):
        same = [l for l in loads if (l.server, l.concurrency) == key]
        rate = statistics.median(l.tokens_per_s for l in same)

        def mean(what: str) -> float | None:
            values = [getattr(l, what) for l in same if getattr(l, what) is not None]
            return statistics.mean(values) if values else None

        parts: dict[str, float] = {}
        for load in same:
            for part, seconds in load.seconds_by_part.items():
                parts[part] = parts.get(part, 0.0) + seconds
        merged.append(Load(key[0], key[1], sum(l.seconds for l in same), [o for l in same for o in l.outcomes],
                           rate, mean("nodes"), mean("per_pass"), mean("accepted_length"), parts))
    return merged


def same_answers(loads: Sequence[Load], baseline: str) -> dict[tuple[str, int], str]:
    """Per (server, C): how many answers equal the baseline server's at that C."""
    out = {}
    for load in loads:
        reference = next((l for l in loads if l.server == baseline and l.concurrency == load.concurrency), None)
        if reference is None:
            continue
        same = sum(a.text == b.text for a, b in zip(load.outcomes, reference.outcomes))
        out[load.server, load.concurrency] = f"{same}/{len(load.outcomes)}"
    return out
