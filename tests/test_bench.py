"""racer bench: summaries recomputed from records, identical counts, outputs."""

import json

import pytest

from racer import bench
from racer.bench import Record, runner, summarize
from racer.cli import main


def rec(method, qid, tokens, wall, steps, category="c"):
    return Record(method, {"method": method}, "d", category, str(qid), len(tokens), steps, [0] * steps,
                  [1] * steps, wall, 0.0, wall, tokens)


def test_summary_figures_by_hand():
    records = [rec("ar", 1, [1, 2, 3, 4], 4.0, 3), rec("ar", 2, [5, 6], 2.0, 1),
               rec("x", 1, [1, 2, 3, 4], 1.0, 1), rec("x", 2, [5, 7], 2.0, 0)]
    for r in records:
        ref = next(b for b in records if b.method == "ar" and b.question_id == r.question_id)
        r.identical = r.tokens == ref.tokens
    rows = {s.method: s for s in summarize(records, "ar")}
    x = rows["x"]
    assert x.n == 2 and x.identical == 1
    assert x.mat == pytest.approx(6 / (2 + 1))          # tokens / passes (steps + 1 each)
    assert x.speedup == pytest.approx((4 + 2) / (1 + 2))  # summed walls
    assert x.median_speedup == pytest.approx((4.0 + 1.0) / 2)
    assert x.ms_per_token == pytest.approx(1000 * 3 / 6)
    assert rows["ar"].speedup == 1.0 and rows["ar"].mat == 1.0


def test_bad_bench_arguments(real):
    model, tok = real
    with pytest.raises(ValueError, match="baseline"):
        bench.run_bench(model, tok, ["pld"], [], baseline="ar")
    assert main(["bench", "--methods", "ar,nope"]) == 2
    assert main(["bench", "--report", "/nonexistent.json"]) == 2


def test_short_real_run_writes_table_json_and_plots(real, tmp_path, monkeypatch, capsys):
    original = runner._Runner.run

    def broken(self, ids, max_new_tokens):  # a deliberately wrong method
        tokens, stats = original(self, ids, max_new_tokens)
        if self.spec.startswith("racer"):
            tokens = tokens[:-1] + [tokens[-1] + 1]
        return tokens, stats

    monkeypatch.setattr(runner._Runner, "run", broken)
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    assert main(["bench", "--methods", "ar,racer:capacity=8,racer:capacity=16", "--datasets", "human_eval",
                 "--limit", "2", "--max-new-tokens", "32", "--warmup", "0", "--threads", "1",
                 "--json", str(out), "--plots", str(plots)]) == 0
    printed = capsys.readouterr().out
    assert "racer:capacity=8" in printed and "0/2" in printed and "2/2" in printed
    data = json.loads(out.read_text())
    assert len(data["records"]) == 6 and data["machine"]["threads"] == 1
    result = bench.BenchResult.from_json(data)
    recomputed = [s.__dict__ for s in summarize(result.records, "ar")]
    assert recomputed == data["summary"]
    for r in data["records"]:
        assert r["new_tokens"] == 32 == len(r["tokens"])
        if r["method"] != "ar":
            assert r["identical"] is False and len(r["accepted"]) == r["steps"] == len(r["tree_sizes"])
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["accepted_hist.png", "mat_vs_capacity_racer.png", "speedup.png"]
    # --report re-renders without running anything.
    assert main(["bench", "--report", str(out)]) == 0
    assert "racer:capacity=16" in capsys.readouterr().out


def test_sampled_bench_is_repeatable_and_compares_nothing(real, tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        assert main(["bench", "--methods", "ar,hf,pld", "--datasets", "human_eval", "--limit", "1",
                     "--max-new-tokens", "16", "--warmup", "0", "--threads", "1", "--temperature", "0.7",
                     "--top-p", "0.9", "--seed", "5", "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    assert "1/1" not in capsys.readouterr().out  # no identical counts for sampled outputs
    assert runs[0]["settings"]["sampling"]["temperature"] == 0.7
    for first, second in zip(runs[0]["records"], runs[1]["records"]):
        assert first["identical"] is None
        assert first["tokens"] == second["tokens"]  # every method repeats with the seed


def test_records_pair_by_position_when_question_ids_repeat():
    """Two sources numbered from 1, concatenated: the same (dataset, category, id)
    twice. Each record pairs with the baseline run on its own prompt."""
    records = [rec("ar", 1, [1, 2], 4.0, 1), rec("ar", 1, [3, 4], 1.0, 1),
               rec("x", 1, [1, 2], 2.0, 1), rec("x", 1, [3, 4], 1.0, 1)]
    for index, record in enumerate(records):
        record.prompt = index % 2
    x = {s.method: s for s in summarize(records, "ar")}["x"]
    assert x.median_speedup == pytest.approx((4.0 / 2.0 + 1.0 / 1.0) / 2)  # not 1.0 / 2.0 and 1.0 / 1.0
    legacy = [rec("ar", 1, [1], 4.0, 0), rec("x", 1, [1], 2.0, 0)]  # a file from before positions were kept
    assert {s.method: s for s in summarize(legacy, "ar")}["x"].speedup == pytest.approx(2.0)


def test_a_file_with_repeated_ids_runs_and_keys_by_position(real, tmp_path):
    questions = tmp_path / "mine.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Name a fruit."]}) + "\n"
                         + json.dumps({"question_id": 1, "category": "c", "turns": ["Count to three."]}) + "\n")
    out = tmp_path / "r.json"
    # --methods without ar: the baseline is the first method.
    assert main(["bench", "--methods", "none,pld", "--datasets", str(questions), "--max-new-tokens", "8",
                 "--warmup", "0", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["baseline"] == "none"
    assert sorted((r["method"], r["prompt"]) for r in data["records"]) == [("none", 0), ("none", 1), ("pld", 0),
                                                                        ("pld", 1)]
    first = {r["method"]: r["tokens"] for r in data["records"] if r["prompt"] == 0}
    second = {r["method"]: r["tokens"] for r in data["records"] if r["prompt"] == 1}
    assert first["none"] != second["none"] and all(r["identical"] for r in data["records"])
