"""``racer bench-serve``'s parts that need no model: reading racer's and vLLM's
counters, tokens per pass, vLLM's server commands, and the server processes' lifecycle."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from racer.bench.clients import Load, Outcome, merge_rounds
from racer.bench.prometheus import parse_counters, seconds_by_part, tokens_per_pass
from racer.bench.servers import VLLM_METHODS, ServerProcess, vllm_server, vllm_speculative_config
from racer.bench.serving import breakdown, table

# Lines as vLLM 0.32's /metrics writes them (labels, _created samples beside _total).
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="SmolLM2-135M-Instruct"} 128.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.7961556842197802e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 78.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",position="0"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",position="1"} 38.0
vllm:generation_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 256.0
vllm:prompt_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 41.0
"""

RACER_METRICS = """\
# TYPE racer_completion_tokens_total counter
racer_completion_tokens_total 300.0
racer_completion_tokens_created 1.79e+09
racer_draft_tokens_accepted_total 200.0
racer_verification_passes_total 100.0
racer_requests_total{route="/v1/chat/completions",status="200"} 3.0
racer_requests_total{route="/metrics",status="200"} 2.0
"""


def test_counters_are_read_from_vllms_and_racers_metrics_summed_over_labels():
    vllm = parse_counters(VLLM_METRICS)
    assert vllm["vllm:spec_decode_num_drafts_total"] == 128.0
    assert vllm["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 78.0  # two positions summed
    assert not any(name.endswith("_created") for name in vllm)
    racer = parse_counters(RACER_METRICS)
    assert racer["racer_requests_total"] == 5.0 and racer["racer_completion_tokens_total"] == 300.0


def test_tokens_per_pass_counts_every_pass_and_vllms_accepted_length_only_drafting_steps():
    before = {"vllm:generation_tokens_total": 56.0, "vllm:spec_decode_num_accepted_tokens_total": 8.0,
              "vllm:spec_decode_num_drafts_total": 28.0}
    per_pass, accepted_length = tokens_per_pass(before, parse_counters(VLLM_METRICS))
    assert per_pass == pytest.approx(200 / (200 - 70))  # 200 tokens in 130 passes
    assert accepted_length == pytest.approx(1 + 70 / 100)
    per_pass, accepted_length = tokens_per_pass({}, parse_counters(RACER_METRICS))
    assert per_pass == pytest.approx(3.0) and accepted_length is None
    assert tokens_per_pass({}, {}) == (None, None)  # a server without /metrics


def test_every_vllm_method_has_its_speculative_config_and_a_bad_name_is_refused():
    assert vllm_speculative_config("none", 5) is None
    assert vllm_speculative_config("ngram", 4) == {"method": "ngram", "num_speculative_tokens": 4}
    assert vllm_speculative_config("ngram3", 5)["prompt_lookup_max"] == 3
    assert vllm_speculative_config("racer", 5, racer_tokens=12) == {
        "method": "custom_class", "model": "racer.integrations.vllm.RacerProposer", "num_speculative_tokens": 12}
    assert vllm_speculative_config("racer")["num_speculative_tokens"] == 16
    assert set(VLLM_METHODS) == {"none", "ngram", "ngram3", "suffix", "racer"}
    with pytest.raises(ValueError, match="--vllm-methods.*'eagle'"):
        vllm_speculative_config("eagle", 5)
    assert vllm_speculative_config("racer:memory=shared", 5, racer_tokens=12) == vllm_speculative_config("racer", 5, 12)
    with pytest.raises(ValueError, match="--vllm-methods: racer: memory: expected one of kept, fresh, shared"):
        vllm_speculative_config("racer:memory=all", 5)


def test_a_vllm_server_is_started_as_a_module_with_its_speculation(tmp_path, monkeypatch):
    started = {}

    class Popen:
        def __init__(self, command, **kwargs):
            started.update(command=command, **kwargs)

    monkeypatch.setattr("racer.bench.servers.subprocess.Popen", Popen)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("RACER_VLLM_METHOD", "racer:memory=fresh")
    server = vllm_server("racer", 8123, "/venv/bin/python", "/models/smol", "smol", "float32", 2, 8, 5, tmp_path,
                         racer_tokens=10)
    command = started["command"]
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec["model"] == "racer.integrations.vllm.RacerProposer" and spec["num_speculative_tokens"] == 10
    assert command[command.index("--served-model-name") + 1] == "smol" and "--enforce-eager" in command
    env = started["env"]
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and started["start_new_session"]
    # "racer" is the proposer's default method, whatever the caller's environment says.
    assert server.name == "vllm racer" and server.model == "smol" and "RACER_VLLM_METHOD" not in env
    server = vllm_server("racer:memory=kept", 8125, "/venv/bin/python", "/models/smol", "smol", "float32", 2, 8, 5,
                         tmp_path)
    assert started["env"]["RACER_VLLM_METHOD"] == "racer:memory=kept" and server.name == "vllm racer:memory=kept"
    vllm_server("none", 8124, "/venv/bin/python", "/models/smol", "smol", "float32", 2, 8, 5, tmp_path)
    assert "--speculative-config" not in started["command"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0]


def test_pausing_and_stopping_a_server_reach_its_children(tmp_path):
    # A parent that starts a child and waits, as vLLM's API server does with its engine.
    script = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);" \
             " print(c.pid, flush=True); time.sleep(300)"
    server = ServerProcess("parent", [sys.executable, "-c", script], 0, "m", tmp_path / "log")
    deadline = time.monotonic() + 30
    while not (tmp_path / "log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "log").read_text().split()[0])
    server.pause()
    time.sleep(0.2)
    assert _state(child) == "T" and _state(server.process.pid) == "T"
    server.resume()
    time.sleep(0.2)
    assert _state(child) != "T"
    server.stop()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.process.poll() is not None and not _alive(child)


def test_the_table_compares_with_the_baseline_and_shows_vllms_figures():
    def load(server: str, c: int, tokens: int, seconds: float, **figures) -> Load:
        return Load(server, c, seconds, [Outcome(0.1, 1.0, tokens, f"answer {c}")], **figures)

    loads = merge_rounds([load("racer serve --method racer", 1, 100, 1.0, per_pass=2.5, nodes=4.0),
                          load("vllm none", 1, 100, 2.0, per_pass=1.0),
                          load("vllm racer", 1, 100, 1.25, per_pass=2.0, accepted_length=2.4)])
    text = table(loads, "vllm none").splitlines()
    assert "vs vllm none" in text[0] and "tokens/pass" in text[0] and "vLLM accepted length" in text[0]
    assert text[2].startswith("| 1 | racer serve --method racer | 100.0 | 2.00x |") and "| 2.50 | - | 4.00 |" in text[2]
    assert text[4].startswith("| 1 | vllm racer | 80.0 | 1.60x |") and "| 2.00 | 2.40 | - | 1/1 |" in text[4]



def test_a_racer_servers_seconds_by_part_become_shares_of_the_loads_wall_time():
    def scrape(verify: float, detokenize: float) -> dict:
        return parse_counters(
            'racer_engine_seconds_total{part="verify"} %s\nracer_engine_seconds_total{part="draft"} 1.0\n'
            'racer_api_seconds_total{part="detokenize"} %s\nracer_requests_total{route="/",status="200"} 3\n'
            % (verify, detokenize))

    parts = seconds_by_part(scrape(10.0, 0.5), scrape(16.0, 0.7))
    assert parts == pytest.approx({"engine.verify": 6.0, "engine.draft": 0.0, "api.detokenize": 0.2})
    assert scrape(1, 2)["racer_engine_seconds_total"] == 2.0  # summed over parts too
    load = Load("racer serve --method racer", 4, 10.0, [], seconds_by_part=parts)
    lines = breakdown([load, Load("vllm none", 4, 10.0, [])]).splitlines()
    assert len(lines) == 3  # the head, its rule and the racer server: vLLM has no parts
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells[:4] == ["4", "racer serve --method racer", "60.0%", "0.0%"]
    assert cells[-4] == "40.0%" and cells[-2] == "2.0%"  # idle/other; the API's detokenize


def test_the_code_editing_workload_carries_the_code_its_answers_rewrite():
    from racer.bench.clients import prompt_pool
    from racer.bench.questions import load_questions

    prompts = prompt_pool("code_edit")
    questions = load_questions("code_edit")
    assert len(prompts) == len(questions) == 48
    kinds = [q.category for q in sorted(questions, key=lambda q: prompts.index(q.prompt))]
    assert kinds[:4] == ["type_hints", "docstring", "rename", "fix_bug"] and kinds[4:8] == kinds[:4]  # in turn
    for question in questions:
        code = question.prompt.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        compile(code, question.key, "exec")  # real, whole functions
        assert len(code.splitlines()) >= 10
    fix = next(q for q in questions if q.category == "fix_bug")
    assert "should be" in fix.prompt
    assert prompt_pool()[:2] == [load_questions("spec_bench")[0].prompt, load_questions("human_eval")[0].prompt]
    with pytest.raises(ValueError, match="--workload: expected one of mix, code_edit, agent"):
        prompt_pool("agents")


def test_agent_sessions_resend_their_growing_conversation_with_real_tool_outputs():
    import importlib
    from pathlib import Path

    from racer.bench.clients import Session, prompt_pool
    from racer.bench.questions import load_questions

    sessions = prompt_pool("agent")
    questions = load_questions("agent_sessions")
    assert len(sessions) == 96 and all(isinstance(s, Session) and len(s.requests) == 4 for s in sessions)
    assert [q.chat for q in questions] == [r for s in sessions for r in s.requests]
    system = sessions[0].requests[0][0]
    for session in sessions:
        assert session.requests[0][0] == system  # one framework's system prompt
        for before, after in zip(session.requests, session.requests[1:]):
            assert after[: len(before)] == before and [m["role"] for m in after[len(before):]] == ["assistant", "user"]
        last = session.requests[-1]
        read, edited = last[5]["content"], last[7]["content"]
        # The file read is the real file with one comparison made non-strict; the edit's
        # observation shows it strict again, as in the file.
        assert last[1]["content"].split("`")[3].startswith("Lib/")
        numbered = dict(line.split("\t", 1) for line in read.splitlines()[1:])
        fixed = dict(line.split("\t", 1) for line in edited.splitlines()[1:])
        changed = [n for n in fixed if numbered.get(n, fixed[n]) != fixed[n]]
        assert len(changed) == 1
        bad, good = numbered[changed[0]], fixed[changed[0]]
        assert bad in (good.replace(" < ", " <= ", 1), good.replace(" > ", " >= ", 1)) and bad != good
    truth = Path(importlib.import_module("difflib").__file__).read_text(encoding="utf-8").splitlines()
    difflib_reads = [s.requests[-1][5]["content"] for s in sessions if "Lib/difflib.py" in s.requests[0][1]["content"]]
    assert difflib_reads
    for read in difflib_reads:
        lines = {int(n): text for n, text in (line.split("\t", 1) for line in read.splitlines()[1:])}
        assert sum(truth[n - 1] != text for n, text in lines.items()) == 1  # one planted change
    assert load_questions("agent_sessions", 2)[-1].question_id == "session-1/4"
