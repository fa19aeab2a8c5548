"""Bench records, their summary (MAT, speedup, median ratio, identical outputs), the
tables printed from them, and their JSON files."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass
class Record:
    method: str
    options: dict
    dataset: str
    category: str
    question_id: str
    new_tokens: int
    steps: int | None  # verification passes after prefill (None: not observable, e.g. hf-pld)
    accepted: list[int] | None
    tree_sizes: list[int] | None
    wall_s: float
    draft_s: float
    verify_s: float
    tokens: list[int]
    identical: bool | None = None  # to the baseline method's tokens on the same prompt
    step_draft_us: list[int] | None = None
    drafter_stats: dict | None = None
    run: int = 0  # which bench run (a merged report holds several); pairs stay within a run
    # The prompt's position in its run: what pairs a record with its baseline (a file's
    # question ids may repeat). None in files written before it was recorded.
    prompt: int | None = None

    @property
    def pair_key(self) -> tuple:
        if self.prompt is not None:
            return (self.run, self.prompt)
        return (self.run, self.dataset, self.category, self.question_id)

    @property
    def passes(self) -> int | None:
        return None if self.steps is None else self.steps + 1


@dataclass
class Summary:
    method: str
    dataset: str
    n: int
    mat: float | None
    ms_per_token: float
    speedup: float
    median_speedup: float
    identical: int | None  # None: sampled outputs, not compared
    mean_tree: float | None = None  # verified nodes per step, root included (None: not observable)


@dataclass
class BenchResult:
    machine: dict
    settings: dict
    records: list[Record] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"machine": self.machine, "settings": self.settings,
                "records": [asdict(r) for r in self.records],
                "summary": [asdict(s) for s in summarize(self.records, self.settings["baseline"])]}

    @staticmethod
    def from_json(data: dict) -> "BenchResult":
        return BenchResult(data["machine"], data["settings"], [Record(**r) for r in data["records"]])


def _group_key(record: Record, by_category: bool) -> tuple[str, str]:
    return (record.method, f"{record.dataset}/{record.category}" if by_category else record.dataset)


def summarize(records: Sequence[Record], baseline: str, by_category: bool = False) -> list[Summary]:
    """Per method and dataset (or Spec-Bench category): MAT = tokens / passes, speedup =
    summed baseline wall / summed method wall (as the paper), and the median of the
    per-prompt ratios."""
    base = {r.pair_key: r for r in records if r.method == baseline}
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault(_group_key(r, by_category), []).append(r)
    out = []
    for (method, dataset), rs in groups.items():
        pairs = [(r, base.get(r.pair_key)) for r in rs]
        pairs = [(r, b) for r, b in pairs if b is not None]
        tokens = sum(r.new_tokens for r in rs)
        passes = [r.passes for r in rs]
        mat = tokens / sum(passes) if None not in passes and sum(passes) else None
        wall = sum(r.wall_s for r in rs)
        base_wall = sum(b.wall_s for _, b in pairs)
        ratios = [b.wall_s / r.wall_s for r, b in pairs if r.wall_s > 0]
        sizes = [size for r in rs for size in (r.tree_sizes or [])]
        observable = all(r.tree_sizes is not None for r in rs)
        out.append(Summary(method, dataset, len(rs), mat, 1000 * wall / tokens if tokens else 0.0,
                           base_wall / sum(r.wall_s for r, _ in pairs) if pairs else float("nan"),
                           statistics.median(ratios) if ratios else float("nan"),
                           sum(bool(r.identical) for r in rs) if all(r.identical is not None for r in rs) else None,
                           sum(sizes) / len(sizes) if observable and sizes else None))
    return out


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None or value != value else pattern.format(value)


def render_tables(result: BenchResult, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    baseline = result.settings["baseline"]
    machine = result.machine
    isa = "/".join(machine.get("isa") or [])
    cpu = f"{machine.get('cpu')} ({isa})" if isa else machine.get("cpu")
    title = (f"racer bench - {cpu}, {machine.get('threads')} threads, torch {machine.get('torch')}, "
             f"transformers {machine.get('transformers')}; speedup vs {baseline}")
    for by_category in (False, True):
        rows = summarize(result.records, baseline, by_category)
        if by_category:
            rows = [r for r in rows if r.dataset.startswith("spec_bench/")]
            if not rows:
                continue
        table = Table(title=title if not by_category else "Spec-Bench by category")
        for column in ("dataset", "method", "n", "MAT", "tree", "ms/token", "speedup", "median", "identical"):
            table.add_column(column, justify="left" if column in ("dataset", "method") else "right")
        for r in sorted(rows, key=lambda s: (s.dataset, result.settings["methods"].index(s.method))):
            table.add_row(r.dataset, r.method, str(r.n), _fmt(r.mat, "{:.2f}"), _fmt(r.mean_tree, "{:.1f}"),
                          f"{r.ms_per_token:.1f}",
                          _fmt(r.speedup, "{:.2f}x"), _fmt(r.median_speedup, "{:.2f}x"),
                          "-" if r.identical is None else f"{r.identical}/{r.n}")
        console.print(table)
    drafting = drafting_rows(result.records, result.settings["methods"])
    if drafting:
        table = Table(title="Drafting per step (pure Python) and accepted draft tokens")
        for column in ("method", "steps", "draft p50 µs", "draft p99 µs", "share of wall", "from retrieval",
                       "copy-logit rank 1"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in drafting:
            table.add_row(row["method"], str(row["steps"]), f"{row['draft_p50_us']:.0f}", f"{row['draft_p99_us']:.0f}",
                          f"{100 * row['draft_share']:.2f}%", _fmt(row.get("retrieval_share"), "{:.0%}"),
                          _fmt(row.get("rank1_share"), "{:.0%}"))
        console.print(table)


def drafting_rows(records: Sequence[Record], methods: Sequence[str]) -> list[dict]:
    """Per method: drafting time per step (p50/p99, µs), its share of the wall time,
    and — for drafters that report them — where accepted draft tokens came from and
    their rank in the copy-logit row."""
    import numpy as np

    rows = []
    for method in methods:
        rs = [r for r in records if r.method == method and r.step_draft_us]
        if not rs:
            continue
        steps = np.array([us for r in rs for us in r.step_draft_us])
        row = {"method": method, "steps": int(steps.size), "draft_p50_us": float(np.percentile(steps, 50)),
               "draft_p99_us": float(np.percentile(steps, 99)),
               "draft_share": sum(r.draft_s for r in rs) / sum(r.wall_s for r in rs)}
        ranks: dict[str, int] = {}
        sources: dict[str, int] = {}
        for r in rs:
            for key, count in ((r.drafter_stats or {}).get("accepted_rank") or {}).items():
                ranks[key] = ranks.get(key, 0) + count
            for key, count in ((r.drafter_stats or {}).get("accepted_source") or {}).items():
                sources[key] = sources.get(key, 0) + count
        if ranks:
            row["rank1_share"] = ranks.get("1", 0) / sum(ranks.values())
        if sources:
            # Tokens retrieval drafted, alone or with the copy-logit table.
            row["retrieval_share"] = (sources.get("retrieval", 0) + sources.get("both", 0)) / sum(sources.values())
        rows.append(row)
    return rows


def save(result: BenchResult, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(result.to_json(), out)


def load(path: str | os.PathLike) -> BenchResult:
    try:
        with open(path, encoding="utf-8") as file:
            return BenchResult.from_json(json.load(file))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"report: {path} is not a racer bench JSON file ({err})") from None


def merge(results: Sequence[BenchResult]) -> BenchResult:
    """Runs made separately (e.g. one process per core) shown as one table; each
    prompt's methods were still interleaved within its own run."""
    first = results[0]
    for other in results[1:]:
        if other.settings["methods"] != first.settings["methods"] or other.settings["baseline"] != first.settings["baseline"]:
            raise ValueError("report: the files were run with different methods or baselines")
    settings = dict(first.settings, prompts=sum(r.settings.get("prompts", 0) for r in results))
    records = []
    for run, result in enumerate(results):
        for record in result.records:
            record.run = run
            records.append(record)
    return BenchResult(first.machine, settings, records)
