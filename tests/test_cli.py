"""The command line: errors are one clear line, methods are listed, generate runs."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from racer.cli import main


@pytest.mark.parametrize("argv, pattern", [
    (["generate", "hi", "--method", "nope"], "method"),
    (["generate", "hi", "--dtype", "int4"], "dtype"),
    (["generate", "hi", "--method", "racer:capacity=0"], "capacity"),
    (["bench-serve", "--concurrency", "1,0"], "concurrency"),
    (["bench-serve", "--methods", "none,nope"], "method"),
    (["bench-serve", "--vllm-methods", "none,eagle"], "--vllm-methods"),  # refused before any server starts
    (["bench-serve", "--vllm", "/nonexistent/python"], "--vllm"),
    (["generate", "hi", "--method", "pld:num_tokens=abc"], "num_tokens: expected an integer, got 'abc'"),
    (["generate", "hi", "--method", "token-recycling:prefill=yes"], "prefill: expected true or false"),
])
def test_bad_arguments_give_one_clear_line(argv, pattern, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert pattern in err and "Traceback" not in err


def test_non_positive_token_limit_is_refused():
    proc = subprocess.run([sys.executable, "-m", "racer.cli", "generate", "hi", "--max-new-tokens", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "max-new-tokens" in proc.stderr and "Traceback" not in proc.stderr


def test_a_memory_scope_outside_the_three_is_refused():
    proc = subprocess.run([sys.executable, "-m", "racer.cli", "serve", "--memory-scope", "everyone"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--memory-scope" in proc.stderr and "Traceback" not in proc.stderr


def test_methods_lists_every_method(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "pld", "racer"):
        assert name in out


def test_generate_with_compare_reports_identical_output(real, capsys):
    assert main(["generate", "Count from 1 to 12.", "--max-new-tokens", "24", "--compare", "--threads", "1",
                 "--method", "racer:capacity=16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "speedup" in captured.err and "identical: yes" in captured.err and "MAT" in captured.err


def test_generate_with_auto_capacity_reports_the_budget(real, capsys):
    assert main(["generate", "Count from 1 to 12.", "--max-new-tokens", "24", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "draft budget:" in err and "nodes verified per step" in err


def test_generate_json_gives_every_token_its_source_and_step(real, capsys):
    import json

    assert main(["generate", "Count from 1 to 12.", "--max-new-tokens", "24", "--threads", "1", "--json",
                 "--compare", "--method", "racer:capacity=16"]) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is the JSON object alone
    tokens = out["tokens"]
    assert out["plain"]["identical"]
    assert len(tokens) == 24 or out["stop_reason"] != "length"
    assert "".join(t["text"] for t in tokens) == out["text"]
    assert {t["source"] for t in tokens} <= {"retrieval", "logits", "both", "none"}
    assert sum(out["provenance"].values()) == len(tokens)
    assert [t["step"] for t in tokens] == sorted(t["step"] for t in tokens) and tokens[0]["step"] == 0
    assert len(out["tree_sizes"]) == out["passes"] - 1 == tokens[-1]["step"]


def test_cost_measures_on_refresh_then_reads_the_cache(real, capsys, tmp_path, monkeypatch):
    # A cache of its own (with the suite's converted model), so that the refresh does not
    # replace the table other tests in flight are reading.
    from racer.loading import cache_dir

    (tmp_path / "models").symlink_to(cache_dir() / "models")
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    assert main(["cost", "--threads", "1", "--refresh"]) == 0
    first = capsys.readouterr().out
    assert "measured now, saved to" in first and "costs" in first
    assert main(["cost", "--threads", "1"]) == 0
    second = capsys.readouterr().out
    assert "cached in" in second
    rows = [line for line in second.splitlines() if line.startswith(("nodes:", "ms:"))]
    assert len(rows) == 2 and len(rows[0].split()) == len(rows[1].split())
    assert first.splitlines()[1:] == second.splitlines()[1:]
    assert str(tmp_path) in first


def test_default_threads_are_the_usable_cores_whatever_the_load(monkeypatch):
    # The thread count keys the cost table: a load-dependent default would recalibrate
    # whenever the machine is busy.
    import os

    from racer.cli import default_threads

    cores = len(os.sched_getaffinity(0))
    for load in (0.0, cores + 3.0):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        assert default_threads() == cores



def _cli(*argv: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "racer.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


@pytest.mark.parametrize("argv, pattern", [
    (["serve", "--port", "99999"], "--port: expected a port number from 1 to 65535, got 99999"),
    (["serve", "--port", "http"], "--port: expected a port number"),
    (["serve", "--prefill-chunk", "0"], "--prefill-chunk: expected a positive integer, got 0"),
    (["generate", "hi", "--device", "cuda:7" if os.environ.get("RACER_TEST_DEVICE") == "cuda" else "cuda"],
     "device: 'cuda"),
    (["generate", "hi", "--model", "/nonexistent/model"], "there is no folder /nonexistent/model"),
])
def test_edges_a_new_user_hits_are_one_line_and_status_2(argv, pattern):
    proc = _cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert pattern in proc.stderr and "Traceback" not in proc.stderr
    assert pattern in proc.stderr.strip().splitlines()[-1]  # the last line says it (argparse prints its usage above)


def test_version():
    import racer

    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"racer {racer.__version__}"
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{racer.__version__}"' in pyproject  # one version, said in both places


def test_a_busy_port_is_said_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = _cli("serve", "--port", str(port))
    assert proc.returncode == 2 and f"127.0.0.1:{port} is already in use" in proc.stderr
    assert "serving" not in proc.stderr and "loading" not in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60  # no model was loaded first


def test_ctrl_c_ends_generate_with_what_it_has_and_status_130(real):
    # As from a terminal: a suite started as a background job of a shell ignores SIGINT,
    # and a Python started with it ignored keeps ignoring it.
    process = subprocess.Popen([sys.executable, "-m", "racer.cli", "generate", "Write a long story about a dragon.",
                                "--max-new-tokens", "4000", "--threads", "1", "--method", "pld"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = process.stdout.read(40)  # the answer has begun to stream
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err.decode()
    assert len(first + out) >= 40 and b"Traceback" not in err and b"interrupted after" in err


def test_generate_in_bfloat16_says_what_lossless_means_there(real):
    proc = _cli("generate", "Count from 1 to 12.", "--max-new-tokens", "24", "--compare", "--threads", "1",
                "--dtype", "bfloat16", "--method", "racer:capacity=16", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "outputs identical:" in proc.stderr and "In bfloat16 a pass over several tokens rounds differently" \
        in proc.stderr
    assert "the argmax of logits computed for its true context, up to 16-bit rounding" in proc.stderr


def test_generate_leaves_a_stop_string_out_as_the_server_does(real, capsys):
    from racer import Decoder

    model, tokenizer = real
    prompt = "Count from 1 to 12, one number per line."
    plain = Decoder(model, tokenizer, "none").generate(prompt, max_new_tokens=40)
    stop = "5"
    assert stop in plain.text
    assert main(["generate", prompt, "--max-new-tokens", "40", "--threads", "1", "--stop", stop,
                 "--method", "pld"]) == 0
    assert capsys.readouterr().out == plain.text[: plain.text.index(stop)] + "\n"


def test_every_command_has_its_function():
    from racer.cli import COMMANDS, _build_parser

    subcommands = _build_parser()._subparsers._group_actions[0].choices
    assert sorted(subcommands) == sorted(COMMANDS)
