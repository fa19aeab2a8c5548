"""The command line: errors are one clear line, methods are listed, generate runs."""

import subprocess
import sys

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

