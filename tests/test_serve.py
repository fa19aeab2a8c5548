"""``racer serve``: a real server process on 127.0.0.1, the embedded model, the official
``openai`` client (and raw HTTP where a client would hide what is sent back)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import http.client
import pytest

from conftest import hf_greedy
from racer import Decoder, DEFAULT_MODEL
from racer.engine import encode_prompt

KEY = "test-key"
MAX_BATCH, MAX_QUEUE = 4, 4
QUESTIONS = ["Name three rivers in Europe.", "Write a haiku about the sea.", "What is 12 times 7?",
             "Give me a Python function that reverses a string.", "Who wrote Hamlet?", "List four colours.",
             "Explain what a CPU cache is in one sentence.", "Translate 'good morning' into French."]


class Reply:
    """An HTTP answer read with the standard library (the openai client hides statuses
    and headers behind its exceptions)."""

    def __init__(self, status: int, headers: dict, text: str) -> None:
        self.status_code, self.headers, self.text = status, headers, text

    def json(self):
        return json.loads(self.text)


def _connection(base: str, timeout: float = 120) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def get(base: str, path: str, timeout: float = 5, key: str | None = None) -> Reply:
    connection = _connection(base, timeout)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode())
    finally:
        connection.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    command = [sys.executable, "-m", "racer.cli", "serve", "--port", str(port), "--threads", "1",
               "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"racer serve exited: {process.stdout.read()}")
        try:
            if get(base, "/health", timeout=1).status_code == 200:
                return process, base
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("racer serve did not start")


@pytest.fixture(scope="module")
def server(real):
    process, base = start_server("--api-key", KEY)
    yield base
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def alone(real):
    """Each question's greedy answer from racer generate, in process (64 tokens)."""
    model, tokenizer = real
    decoder = Decoder(model, tokenizer, "racer")
    out = {}
    for question in QUESTIONS:
        result = decoder.generate([{"role": "user", "content": question}], chat=True, max_new_tokens=64)
        out[question] = result
    return out


def ask(client, question: str, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 64, **kwargs}
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": question}],
                                          **kwargs)


def test_chat_answer_is_racer_generate_and_hf_generate(client, alone, real):
    model, tokenizer = real
    question = QUESTIONS[0]
    answer = ask(client, question)
    assert answer.choices[0].message.content == alone[question].text
    ids = encode_prompt(tokenizer, [{"role": "user", "content": question}], chat=True)
    assert answer.choices[0].message.content == tokenizer.decode(hf_greedy(model, ids, 64), skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(alone[question].tokens)
    assert answer.choices[0].finish_reason == ("length" if len(alone[question].tokens) == 64 else "stop")


def test_streamed_chat_is_the_same_text(client, alone):
    question = QUESTIONS[1]
    stream = ask(client, question, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    assert "".join(pieces) == alone[question].text
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.completion_tokens == len(alone[question].tokens)


def test_completion_of_raw_text(client, real):
    model, tokenizer = real
    prompt = "The three largest cities in France are"
    answer = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=24)
    want = Decoder(model, tokenizer, "racer").generate(prompt, chat=False, max_new_tokens=24)
    assert answer.choices[0].text == want.text
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


def test_stop_strings_end_the_answer_before_them(client, alone):
    question = QUESTIONS[5]
    text = alone[question].text
    stop = text.split()[2]  # a word the answer reaches
    answer = ask(client, question, stop=[stop, "zzzz"])
    assert answer.choices[0].message.content == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    streamed = ask(client, question, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_max_tokens_ends_with_length(client):
    answer = ask(client, QUESTIONS[3], max_tokens=5)
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"


def test_a_seed_repeats_a_sampled_answer(client):
    kwargs = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTIONS[4]}], temperature=1.0,
                  top_p=0.9, seed=11, max_tokens=24)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_eight_concurrent_clients_get_what_they_get_alone(client, alone):
    answers: dict[str, str] = {}

    def one(question: str, delay: float) -> None:
        time.sleep(delay)  # some join while others decode
        answers[question] = ask(client, question).choices[0].message.content

    threads = [threading.Thread(target=one, args=(q, 0.4 * (i % 3))) for i, q in enumerate(QUESTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert answers == {q: alone[q].text for q in QUESTIONS}


def _post(server: str, path: str, body, key: str | None = KEY) -> Reply:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = _connection(server)
    try:
        connection.request("POST", path, body=content, headers={**headers, "Content-Type": "application/json"})
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode())
    finally:
        connection.close()


def _open_stream(server: str, body: dict, key: str | None = KEY) -> tuple[http.client.HTTPConnection, object]:
    connection = _connection(server)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", b"{not json", 400, None, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None, None),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    # SmolLM2's chat template does not read tools: said, never ignored.
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", None),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "42"}]}, 400,
     "messages[0].tool_call_id", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": None}]}, 400,
     "messages[0].content", None),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, 400, "stop", None),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 400, "seed", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role",
     None),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"model": DEFAULT_MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"model": DEFAULT_MODEL}, 400, "prompt", None),
])
def test_bad_requests_get_their_status_and_an_openai_error_body(server, path, body, status, param, code):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    assert _post(server, "/v1/chat/completions", CHAT).status_code == 200  # and the server goes on


def test_unknown_routes_and_methods_get_openais_error_body(server):
    missing = get(server, "/v1/chat/nothing", key=KEY)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "/v1/chat/nothing" in missing.json()["error"]["message"]
    wrong = get(server, "/v1/chat/completions", key=KEY)  # GET on a POST route
    error = wrong.json()["error"]
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and set(error) == {"message", "type",
                                                                                            "param", "code"}
    assert get(server, "/static/missing.js").json()["error"]["code"] == "not_found"


def test_metrics_count_unknown_paths_under_one_label(server):
    for probe in ("/wp-admin/setup.php", "/.env", "/v1/probe/1", "/v1/probe/2"):
        get(server, probe)
    routes = {line.split('route="')[1].split('"')[0] for line in get(server, "/metrics").text.splitlines()
              if line.startswith("racer_requests_total{")}
    assert "other" in routes and not any("probe" in r or "wp-admin" in r or ".env" in r for r in routes)
    assert routes <= {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
                      "/static/{file}", "other"}


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30) as raw:
        # The headers announce 5 MB; only the first bytes are sent: the answer comes anyway.
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000000\r\n\r\n{\"model\"")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):  # the head and body may come apart
            more = raw.recv(65536)
            if not more:
                break
            answer += more
        head, _, body = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert get(server, "/health").status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """A prompt of 3.5 MB (under the body limit, far over the context) takes seconds
    to template and tokenize; meanwhile the event loop goes on answering."""
    body = {**CHAT, "messages": [{"role": "user", "content": "word and other things " * 160_000}]}
    done: dict = {}

    def huge() -> None:
        done["reply"] = _post(server, "/v1/chat/completions", body)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=huge)
    thread.start()
    answered = []
    while thread.is_alive():
        if get(server, "/health", timeout=30).status_code == 200:
            answered.append(time.monotonic())
        time.sleep(0.05)
    thread.join()
    assert done["reply"].status_code == 400 and done["reply"].json()["error"]["code"] == "context_length_exceeded"
    assert sum(at < done["at"] for at in answered) >= 3  # before the huge one was answered


def test_a_whole_request_whose_client_gave_up_is_cancelled(server):
    """A non-streamed request's client times out: its row is freed at the next step,
    not decoded to max_tokens (the answer it would have had is counted as a 499)."""
    connection = _connection(server, timeout=1.5)
    body = {**CHAT, "max_tokens": 3000, "messages": [{"role": "user", "content": "Write a very long story."}]}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(OSError):  # socket.timeout
        connection.getresponse()
    connection.close()
    deadline = time.monotonic() + 20
    while _in_flight(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(server) == 0
    assert 'route="/v1/chat/completions",status="499"' in get(server, "/metrics").text


def test_an_agent_history_is_accepted_and_answered_as_alone(server, real):
    """Tool results and an assistant turn with content null and tool_calls, as agent
    frameworks send them; the answer is the one racer gives the same history alone."""
    from racer.serve import protocol

    model, tokenizer = real
    messages = [{"role": "system", "content": "Answer with the tool's result."},
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    reply = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 24, "messages": messages})
    assert reply.status_code == 200, reply.text
    parsed = protocol.parse_request("chat", {"model": "m", "messages": messages}, "m").prompt
    ids = encode_prompt(tokenizer, parsed, True)
    assert "get_weather" in tokenizer.decode(ids)  # the template knows no tool_calls: the call is written as text
    alone = Decoder(model, tokenizer, "none").generate(ids, max_new_tokens=24)
    assert reply.json()["choices"][0]["message"]["content"] == alone.text


def test_a_missing_or_wrong_api_key_is_401(server):
    for key in (None, "wrong"):
        response = _post(server, "/v1/chat/completions", CHAT, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert get(server, "/health").status_code == 200  # health needs no key
    assert get(server, "/health").json()["api_key_required"] is True  # and tells the chat page to ask for one


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL]
    ask(client, QUESTIONS[2], max_tokens=8)
    text = get(server, "/metrics").text
    for name in ("racer_requests_total", "racer_completion_tokens_total", "racer_draft_tokens_accepted_total",
                 "racer_batch_size", "racer_queue_length"):
        assert name in text


def test_usage_says_how_many_prompt_tokens_a_kept_prefix_gave(server, client):
    """The same long prompt twice: the first is prefilled whole (``cached_tokens`` 0),
    the second starts from the first's kept KV (every token but the last, which is
    computed for its logits), as OpenAI's ``prompt_tokens_details`` reports prompt
    caching; the answers are the same and ``/metrics`` counts the cached tokens."""
    import re

    content = " ".join(f"Item {i}: a lantern, a rope and {i} maps of the northern coast." for i in range(12))
    messages = [{"role": "user", "content": content + " Which item has the most maps?"}]
    before = get(server, "/metrics").text
    first, second = (client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=8,
                                                    temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content

    def cached(text):
        found = re.search(r"^racer_prompt_tokens_cached_total (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    assert cached(get(server, "/metrics").text) - cached(before) == second.usage.prompt_tokens - 1


def _events(response) -> list[dict]:
    events = []
    for line in response.read().decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def test_racers_extension_says_which_source_drafted_each_run_of_text(server, alone):
    question = QUESTIONS[3]
    body = {**CHAT, "messages": [{"role": "user", "content": question}], "max_tokens": 64, "racer": True}
    whole = _post(server, "/v1/chat/completions", body).json()
    text, extension = whole["choices"][0]["message"]["content"], whole["racer"]
    assert text == alone[question].text
    assert sum(n for n, _, _ in extension["spans"]) == len(text)
    assert {source for _, source, _ in extension["spans"]} <= {"retrieval", "logits", "both", "none"}
    assert sum(extension["provenance"].values()) == whole["usage"]["completion_tokens"]
    # The model's own token ends each pass (the last may be cut before it by max_tokens).
    assert extension["passes"] - 1 <= extension["provenance"]["none"] <= extension["passes"]
    assert len(extension["tree_sizes"]) == extension["passes"] - 1

    connection, response = _open_stream(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    try:
        events = _events(response)
    finally:
        connection.close()
    pieces = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in pieces) == text
    for event in pieces:  # each chunk's runs cover exactly its text
        assert sum(n for n, _, _ in event["racer"]["spans"]) == len(event["choices"][0]["delta"]["content"])
    # The streamed request drafts on its own (the server's drafter memory has seen the
    # question once more): its chunks agree with its own final statistics.
    final = next(e["racer"] for e in events if not e["choices"])
    streamed = [run for e in pieces for run in e["racer"]["spans"]]
    assert [(s, n) for c, s, n in streamed for _ in range(c)] == [(s, n) for c, s, n in final["spans"] for _ in range(c)]
    steps = [step for e in events if "racer" in e and "steps" in e["racer"] for step in e["racer"]["steps"]]
    assert sum(tokens for _, _, tokens, _ in steps) == whole["usage"]["completion_tokens"]
    assert [nodes for step, nodes, _, _ in steps if step > 0] == final["tree_sizes"]
    assert sum(drafted for *_, drafted in steps) == whole["usage"]["completion_tokens"] - final["provenance"]["none"]

    plain = _post(server, "/v1/chat/completions", {**body, "racer": False}).json()
    assert "racer" not in plain and plain["choices"][0]["message"]["content"] == text


def test_streamed_text_is_the_decode_of_its_tokens_across_split_characters_and_stops(client, real):
    """Text streamed as tokens come (decoded incrementally in the API process) is exactly
    ``tokenizer.decode`` of the answer's tokens, cut before a stop string of several
    tokens, where characters are split over byte-level tokens."""
    _, tokenizer = real
    prompt = ("Japanese: こんにちは世界。Chinese: 你好，世界。Emoji: 🚀🎉👩‍💻.\n"
              "Japanese: こんにちは世界。Chinese: 你好，世界。Emoji: 🚀🎉👩‍💻.\nJapanese:")
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                      extra_body={"racer": True})
    ids = whole.model_extra["racer"]["completion_token_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole.choices[0].text == decoded
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # characters split over tokens
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == decoded
    # A stop string of several tokens, from the middle of the answer.
    middle = len(decoded) // 2
    stop = decoded[middle : middle + 4]
    assert len(tokenizer(stop, add_special_tokens=False)["input_ids"]) >= 2
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                         stream=True, stop=[stop])
    assert "".join(c.choices[0].text for c in streamed if c.choices) == decoded[: decoded.index(stop)]


def test_the_chat_page_and_its_files_are_served_with_nothing_from_elsewhere(server):
    page = get(server, "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("chat.js", "chat.css"):
        assert f"/static/{name}" in page.text
        asset = get(server, f"/static/{name}")
        assert asset.status_code == 200 and len(asset.text) > 500
        assert "http://" not in asset.text and "https://" not in asset.text
    assert "http://" not in page.text and "https://" not in page.text
    assert get(server, "/static/missing.js").status_code == 404
    assert get(server, "/health").json()["method"] == "racer"


def _in_flight(server: str) -> int:
    return get(server, "/health").json()["in_flight"]


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, client):
    connection, response = _open_stream(server, {**CHAT, "max_tokens": 400, "stream": True})
    for _ in range(3):
        assert response.readline()
    connection.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while _in_flight(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_flight(server) == 0
    assert ask(client, QUESTIONS[2], max_tokens=8).choices[0].message.content


def test_three_times_the_queue_at_once_refuses_the_excess_and_answers_the_rest(server):
    count = 3 * MAX_QUEUE  # more than the batch and the queue hold
    statuses: list[int] = []

    def one(i: int) -> None:
        body = {**CHAT, "max_tokens": 24, "messages": [{"role": "user", "content": QUESTIONS[i % 8]}]}
        response = _post(server, "/v1/chat/completions", body)
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.headers.get("retry-after") and response.json()["error"]["type"] == "rate_limit_error"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(statuses) == count and set(statuses) <= {200, 429}
    assert statuses.count(200) >= MAX_BATCH + MAX_QUEUE and statuses.count(429) > 0
    assert _in_flight(server) == 0


def test_sigterm_during_a_stream_finishes_or_ends_it_and_exits(real):
    process, base = start_server("--grace", "2")
    connection, response = _open_stream(base, {**CHAT, "max_tokens": 2000, "stream": True}, key=None)
    received = [response.readline()]
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        while line := response.readline():
            received.append(line)
    except (OSError, http.client.HTTPException):
        pass  # the grace ran out and the server closed the stream
    connection.close()
    # uvicorn shuts down gracefully, then re-raises the signal: the exit status is SIGTERM's
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert time.monotonic() - started < 30
    log = process.stdout.read()
    assert "racer serve: stopped" in log, log  # the shutdown ran (engine stopped), not a kill
    # What it did before the port opened was said before "serving on".
    assert log.index("racer serve: loading") < log.index("racer serve: serving"), log
    assert received[0].startswith(b"data: ")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as cmdline:
            return cmdline.read()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_killed_server_leaves_no_engine_process_behind(real):
    """The engine runs in a child process; killing the API process (SIGKILL: no
    shutdown runs) while the engine is still loading ends the engine too."""
    process = subprocess.Popen([sys.executable, "-m", "racer.cli", "serve", "--port", str(free_port()),
                                "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    engines: list[int] = []
    while not engines and time.monotonic() < deadline:
        time.sleep(0.2)
        engines = [p for p in _children(process.pid) if "spawn_main" in _cmdline(p)]
    assert engines, "no engine process was started"
    process.kill()
    process.wait(timeout=30)
    deadline = time.monotonic() + 90  # a loaded machine may take long to import torch in it
    while any(_alive(p) for p in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in engines)


def test_sampling_through_the_server_is_exactly_distributed(server, real):
    """The first two tokens of 300 seeded requests, 4 at a time, against the model's own
    distribution (temperature 0.6, top_p 0.6: six outcomes): Pearson's chi-square."""
    from test_sampling import chi2, chi2_critical, exact_distribution

    model, tokenizer = real
    messages = [{"role": "user", "content": "Pick a random fruit and name it."}]
    probs, _ = exact_distribution(model, encode_prompt(tokenizer, messages, chat=True), 2,
                                  temperature=0.6, top_p=0.6)
    runs, counts, verified = 300, {}, []
    lock = threading.Lock()

    def client_(first: int) -> None:
        for seed in range(first, runs, 4):
            body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 2, "temperature": 0.6,
                    "top_p": 0.6, "seed": seed, "racer": True}
            reply = _post(server, "/v1/chat/completions", body).json()
            with lock:
                key = tuple(reply["racer"]["completion_token_ids"])
                counts[key] = counts.get(key, 0) + 1
                verified.append(reply["racer"]["draft_tokens_verified"])

    threads = [threading.Thread(target=client_, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sum(counts.values()) == runs and sum(verified) > 0  # second tokens went through draft trees
    stat, df = chi2(counts, probs, runs)
    assert df >= 4 and stat < chi2_critical(df), (stat, df, counts)


def test_the_load_generator_reports_refused_requests_as_errors(server):
    from racer.bench.clients import run_load

    host, port = server.removeprefix("http://").split(":")
    # The fixture's server wants a key; the load generator sends none, so expect 401s
    # to be reported as errors, not counted as answers.
    refused = run_load("keyed", host, int(port), DEFAULT_MODEL, QUESTIONS[:2], 2, 8)
    assert refused.errors == 2 and "401" in refused.outcomes[0].error


def test_the_load_generator_times_streamed_answers(real):
    """``racer bench-serve``'s client: streamed greedy answers, their usage, their times;
    a session's calls from one client, in order, after the prompts alone."""
    from racer.bench.clients import Session, merge_rounds, run_load
    from racer.bench.prometheus import counters, nodes_per_pass
    from racer.bench.serving import table

    first = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": QUESTIONS[2]}]
    then = first + [{"role": "assistant", "content": "84."}, {"role": "user", "content": "And 12 times 8?"}]
    prompts = [QUESTIONS[0], QUESTIONS[1], Session((first, then))]
    process, base = start_server("--max-batch", "2")
    try:
        host, port = base.removeprefix("http://").split(":")
        before = counters(int(port))
        loads = [run_load("racer", host, int(port), DEFAULT_MODEL, prompts, 2, 12) for _ in range(2)]
        after = counters(int(port))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    model, tokenizer = real
    decoder = Decoder(model, tokenizer, "none")
    asked = [[{"role": "user", "content": QUESTIONS[0]}], [{"role": "user", "content": QUESTIONS[1]}], first, then]
    for load in loads:
        assert load.errors == 0 and len(load.outcomes) == 4
        for messages, outcome in zip(asked, load.outcomes):
            expected = decoder.generate(messages, chat=True, max_new_tokens=12)
            assert outcome.text == expected.text and outcome.tokens == len(expected.tokens)
            assert 0 < outcome.ttft <= outcome.latency
    assert after["racer_completion_tokens_total"] - before.get("racer_completion_tokens_total", 0) == sum(
        o.tokens for load in loads for o in load.outcomes)
    assert nodes_per_pass(before, after) >= 1.0
    merged = merge_rounds(loads)
    assert len(merged) == 1 and len(merged[0].outcomes) == 8
    assert min(l.tokens_per_s for l in loads) <= merged[0].tokens_per_s <= max(l.tokens_per_s for l in loads)
    assert "| 2 | racer |" in table(merged, "racer")
