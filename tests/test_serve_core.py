"""The server's engine core and the API side's handle on it, without HTTP: events flow
and the registry empties; a failing step fails its requests and the core goes on; the
queue bound; cancellation; the core in a process of its own; the protocol's checks."""

from __future__ import annotations

import queue
import time

import pytest

from conftest import make_tiny_llama
from racer import BatchDecoder, GenerationOptions
from racer.serve import protocol
from racer.serve.core import EngineSpec
from racer.serve.core_client import CoreClient, QueueFull
from racer.serve.events import Failed, Finished, Stepped, Tokens


def sink():
    box: "queue.Queue" = queue.Queue()
    return box, box.put


def drain(box, timeout: float = 60) -> list:
    out = []
    while True:
        event = box.get(timeout=timeout)
        out.append(event)
        if not isinstance(event, Tokens):
            return out


def wait_empty(core, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while core.held and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture()
def core():
    steps = []
    decoder = BatchDecoder(make_tiny_llama(), None, "pld", max_batch=2)
    running = CoreClient.in_thread(decoder, max_queue=1, on_step=steps.append)
    running.steps = steps
    yield running
    running.stop(grace=5)


def test_requests_flow_through_the_core(core):
    box, deliver = sink()
    core.submit([5, 17, 42, 8, 5, 17], GenerationOptions(max_new_tokens=12), deliver)
    events = drain(box)
    assert isinstance(events[-1], Finished) and len(events[-1].result.tokens) == 12
    assert sum((e.tokens for e in events if isinstance(e, Tokens)), []) == events[-1].result.tokens
    wait_empty(core)
    assert core.held == 0
    assert core.steps and all(isinstance(s, Stepped) for s in core.steps)
    parts = set().union(*(s.seconds for s in core.steps))
    assert {"prefill", "draft", "verify", "emit", "finish", "hand_off"} <= parts
    assert sum(s.seconds["verify"] for s in core.steps) > 0


def test_a_failing_step_fails_its_requests_and_the_core_goes_on(core, monkeypatch):
    real_step = core.core.decoder.step
    calls = []

    def failing_step(**kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a drafter broke")
        return real_step(**kwargs)

    monkeypatch.setattr(core.core.decoder, "step", failing_step)
    box, deliver = sink()
    core.submit([5, 17, 42, 8], GenerationOptions(max_new_tokens=40), deliver)
    events = drain(box)
    assert isinstance(events[-1], Failed) and "a drafter broke" in events[-1].message and not events[-1].refused
    box, deliver = sink()  # the next request is served by a fresh decoder
    core.submit([5, 17, 42, 8], GenerationOptions(max_new_tokens=6), deliver)
    assert isinstance(drain(box)[-1], Finished)


def test_a_prompt_the_engine_refuses_fails_as_the_clients_fault(core):
    box, deliver = sink()
    core.submit([5] * 100_000, GenerationOptions(max_new_tokens=2), deliver)
    event = drain(box)[-1]
    assert isinstance(event, Failed) and event.refused and "context window" in event.message


def test_the_queue_bound_refuses_the_excess(core):
    held = []
    for _ in range(core.capacity):
        box, deliver = sink()
        held.append((box, core.submit([5, 17, 42], GenerationOptions(max_new_tokens=200), deliver)))
    with pytest.raises(QueueFull, match="in flight or queued"):
        core.submit([5, 17, 42], GenerationOptions(max_new_tokens=2), sink()[1])
    for box, key in held:
        core.cancel(key)
    for box, _ in held:
        last = drain(box)[-1]
        assert isinstance(last, Finished) and last.result.stop_reason in ("cancelled", "length")


def test_stopping_cancels_what_is_in_flight_and_refuses_more(core):
    box, deliver = sink()
    core.submit([5, 17, 42], GenerationOptions(max_new_tokens=100_000 // 100), deliver)
    core.stop(grace=0)
    last = drain(box)[-1]
    assert isinstance(last, Finished) and last.result.stop_reason in ("cancelled", "length")
    with pytest.raises(QueueFull, match="shutting down"):
        core.submit([5, 17], GenerationOptions(max_new_tokens=2), sink()[1])


def test_the_core_in_its_own_process_decodes_what_it_decodes_alone(real):
    """racer serve's layout: the engine in a spawned process, token ids both ways."""
    model, tokenizer = real
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    alone = BatchDecoder(model, tokenizer, "racer", max_batch=1).generate_all([prompt], max_new_tokens=24)[0]
    steps = []
    core = CoreClient.in_process(EngineSpec(None, "racer", max_batch=2, threads=1), max_queue=2,
                                 on_step=steps.append)
    try:
        assert core.wait_ready(timeout=600).context == model.config.max_position_embeddings
        boxes = [sink() for _ in range(2)]
        for box, deliver in boxes:
            core.submit(prompt, GenerationOptions(max_new_tokens=24), deliver)
        for box, _ in boxes:
            events = drain(box, timeout=300)
            assert isinstance(events[-1], Finished) and events[-1].result.tokens == alone.tokens
            assert events[-1].result.text == ""  # the API side decodes
            assert sum((e.tokens for e in events if isinstance(e, Tokens)), []) == alone.tokens
        assert steps and steps[-1].seconds["verify"] > 0
    finally:
        core.stop(grace=5)
    assert core.held == 0
    with pytest.raises(QueueFull, match="shutting down"):
        core.submit(prompt, GenerationOptions(max_new_tokens=2), sink()[1])


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "racer": "yes"}, "racer"),
])
def test_protocol_names_the_field_it_refuses(body, param):
    with pytest.raises(protocol.ApiError) as caught:
        protocol.parse_request("chat", body, "m")
    assert caught.value.status == 400 and caught.value.param == param


def test_protocol_takes_what_clients_send_by_default():
    body = {"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "tools": None}
    request = protocol.parse_request("chat", body, "m")
    assert request.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.temperature == 1.0 and request.max_tokens is None and not request.stream


def test_protocol_takes_agent_turns_as_chat_templates_take_them():
    body = {"model": "m", "tool_choice": "auto", "parallel_tool_calls": False,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18 C"}]}]}
    request = protocol.parse_request("chat", body, "m")
    assert request.prompt == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    assert request.tools == body["tools"]
    assert protocol.parse_request("chat", {**body, "tool_choice": "none"}, "m").tools is None


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_protocol_names_the_agent_field_it_refuses(change, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(protocol.ApiError) as caught:
        protocol.parse_request("chat", body, "m")
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_a_template_that_reads_tools_gets_them(real):
    import copy

    from racer import chat_template_takes, encode_prompt

    _, tokenizer = real
    assert not chat_template_takes(tokenizer, "tools")
    with pytest.raises(ValueError, match="tools: this model's chat template does not take tools"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    tooled = copy.deepcopy(tokenizer)
    tooled.chat_template = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
                            "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                            "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    assert chat_template_takes(tooled, "tools")
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = tooled.decode(encode_prompt(tooled, [{"role": "user", "content": "hi"}], tools=tools))
    assert "Tools: get_weather" in text


def test_route_labels_are_a_fixed_set():
    from racer.serve.app import ROUTES, route_label

    assert [route_label(r) for r in ROUTES] == list(ROUTES)
    assert route_label("/static/chat.js") == route_label("/static/x/y") == "/static/{file}"
    assert {route_label(p) for p in ("/v1/x", "/admin", "/health/", "/" + "a" * 999)} == {"other"}


def test_a_body_is_read_up_to_its_limit():
    import asyncio

    from racer.serve.app import read_body

    async def chunks(*parts: bytes):
        for part in parts:
            yield part

    def read(length, *parts, limit=10):
        return asyncio.run(read_body(chunks(*parts), length, limit))

    assert read(None, b"12345", b"67890") == b"1234567890"
    for length, parts in ((None, (b"123456", b"78901")), ("11", (b"1",)), ("11", ())):
        with pytest.raises(protocol.ApiError) as caught:  # a chunked body counted as it comes; a length at once
            read(length, *parts)
        assert caught.value.status == 413 and caught.value.code == "request_too_large"
    with pytest.raises(protocol.ApiError, match="Content-Length"):
        read("ten", b"1")
