"""vLLM's OpenAI server with racer's proposer, started as ``racer bench-serve --vllm``
starts it, asked by the official ``openai`` client: the same answers as the server
without speculation, streamed and not, with drafts accepted. Skipped where vLLM is not
installed (racer's own environment; ``make test-vllm`` runs it)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from racer.bench.questions import load_questions  # noqa: E402
from racer.bench.prometheus import counters, tokens_per_pass  # noqa: E402
from racer.bench.servers import free_port, vllm_server  # noqa: E402
from racer.loading import model_folder  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def answers(method: str, prompts: list[str], tmp_path) -> tuple[list[str], list[str], dict, dict]:
    """One server: each prompt answered whole and streamed (greedy, 96 tokens)."""
    server = vllm_server(method, free_port(), sys.executable, str(model_folder(None)), NAME, "float32", None, 4, 5,
                         tmp_path)
    try:
        server.wait_ready(600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
        before = counters(server.port)
        whole, streamed = [], []
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}]
            reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=96, temperature=0)
            whole.append(reply.choices[0].message.content)
            stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=96, temperature=0,
                                                    stream=True)
            streamed.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
        return whole, streamed, before, counters(server.port)
    finally:
        server.stop()


def test_vllms_server_with_racers_proposer_answers_as_without_speculation(tmp_path):
    prompts = [q.prompt for q in load_questions("human_eval")[:2] + load_questions("mgsm")[:2]]
    plain, plain_streamed, _, _ = answers("none", prompts, tmp_path)
    racer, racer_streamed, before, after = answers("racer", prompts, tmp_path)
    assert all(plain) and racer == plain and racer_streamed == plain_streamed == plain
    per_pass, accepted_length = tokens_per_pass(before, after)
    assert per_pass > 1.0 and accepted_length > 1.0  # drafts were made and accepted
