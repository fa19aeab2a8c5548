"""``racer bench``: every method side by side on one loaded model, interleaved per
prompt, with per-prompt records from which every summary figure is recomputed.

Only the public API is used: ``load_model``, ``Decoder`` and the drafter registry.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HF_METHODS = ("hf", "hf-pld")
WARMUP_PROMPT = "Say hello and introduce yourself in two sentences."


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


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _group_key(record: Record, by_category: bool) -> tuple[str, str]:
    return (record.method, f"{record.dataset}/{record.category}" if by_category else record.dataset)


def summarize(records: Sequence[Record], baseline: str, by_category: bool = False) -> list[Summary]:
    """Per method and dataset (or Spec-Bench category): MAT = tokens / passes, speedup =
    summed baseline wall / summed method wall (as the paper), and the median of the
    per-prompt ratios."""
    base = {(r.run, r.dataset, r.category, r.question_id): r for r in records if r.method == baseline}
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault(_group_key(r, by_category), []).append(r)
    out = []
    for (method, dataset), rs in groups.items():
        pairs = [(r, base.get((r.run, r.dataset, r.category, r.question_id))) for r in rs]
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


class _Runner:
    """Runs one method on a prompt and returns a Record."""

    def __init__(self, spec: str, model: Any, tokenizer: Any, sampling: dict | None = None) -> None:
        from racer.engine import Decoder

        self.spec = spec
        self.sampling = dict(sampling or {})
        self.calls = 0
        self.model, self.tokenizer = model, tokenizer
        if spec in HF_METHODS:
            self.decoder = None
            self.options: dict = {"method": spec}
        else:
            self.decoder = Decoder(model, tokenizer, "none" if spec == "ar" else spec)
            self.options = self.decoder.drafter.describe()

    def _sampling_now(self) -> dict:
        # Each call gets its own seed, derived from the bench seed, so a rerun repeats.
        sampling = dict(self.sampling)
        if sampling.get("seed") is not None:
            sampling["seed"] = sampling["seed"] * 1_000_003 + self.calls
        self.calls += 1
        return sampling

    def run(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        sampling = self._sampling_now()
        if self.decoder is None:
            import torch

            tensor = torch.tensor([ids])
            extra: dict[str, Any] = {"prompt_lookup_num_tokens": 10} if self.spec == "hf-pld" else {}
            temperature = sampling.get("temperature", 0.0)
            if temperature > 0:
                if sampling.get("seed") is not None:
                    torch.manual_seed(sampling["seed"])
                extra.update(do_sample=True, temperature=temperature, top_p=sampling.get("top_p", 1.0),
                             top_k=sampling.get("top_k", 0))  # 0 switches HF's default top-k of 50 off
            else:
                extra.update(do_sample=False, top_p=None, top_k=None, temperature=None)
            if sampling.get("repetition_penalty", 1.0) != 1.0:
                extra["repetition_penalty"] = sampling["repetition_penalty"]
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(tensor, attention_mask=torch.ones_like(tensor),
                                          max_new_tokens=max_new_tokens, **extra)
            wall = time.perf_counter() - start
            tokens = out[0, len(ids):].tolist()
            # HF's prompt lookup hides its passes; plain generate makes one per token.
            steps = None if self.spec == "hf-pld" else max(0, len(tokens) - 1)
            return tokens, dict(steps=steps, accepted=None, tree_sizes=None, wall_s=wall, draft_s=0.0, verify_s=wall)
        result = self.decoder.generate(ids, max_new_tokens=max_new_tokens, **sampling)
        return result.tokens, dict(steps=len(result.steps), accepted=[s.accepted for s in result.steps],
                                   tree_sizes=[s.tree_size for s in result.steps], wall_s=result.wall_s,
                                   draft_s=sum(s.draft_s for s in result.steps),
                                   verify_s=sum(s.verify_s for s in result.steps),
                                   step_draft_us=[round(s.draft_s * 1e6) for s in result.steps],
                                   drafter_stats=result.drafter_stats or None)


def run_bench(model: Any, tokenizer: Any, methods: Sequence[str], questions: Sequence[Any], *,
              max_new_tokens: int = 256, baseline: str = "ar", warmup: int = 1, threads: int = 1,
              sampling: dict | None = None, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run every method on every question, rotating the method order per question.
    ``sampling``: keyword arguments of ``Decoder.generate`` (temperature, top_p, ...;
    greedy when absent). Sampled outputs are not compared (``identical`` is None)."""
    from racer.engine import encode_prompt

    if not methods:
        raise ValueError("methods: expected at least one method")
    if baseline not in methods:
        raise ValueError(f"baseline: expected one of the methods ({', '.join(methods)}), got {baseline!r}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods: each method once, got {', '.join(methods)}")
    sampling = dict(sampling or {})
    greedy = sampling.get("temperature", 0.0) == 0
    runners = [_Runner(spec, model, tokenizer, sampling) for spec in methods]
    result = BenchResult(machine_info(threads), {"methods": list(methods), "baseline": baseline,
                                                 "max_new_tokens": max_new_tokens, "warmup": warmup,
                                                 "prompts": len(questions), "sampling": sampling})
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q.prompt}], chat=True) for q in questions]
    # Warm-up (lazy initialisation, allocator, caches), not recorded; on a prompt of its
    # own so that no drafter that keeps memory has seen a measured prompt.
    warm_ids = encode_prompt(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}], chat=True)
    for _ in range(warmup):
        for runner in runners:
            runner.run(warm_ids, min(16, max_new_tokens))
    for index, (question, ids) in enumerate(zip(questions, prompts)):
        shift = index % len(runners)
        done: dict[str, Record] = {}
        for runner in runners[shift:] + runners[:shift]:
            tokens, stats = runner.run(ids, max_new_tokens)
            done[runner.spec] = Record(runner.spec, runner.options, question.dataset, question.category,
                                       question.question_id, len(tokens), tokens=tokens, **stats)
            if progress:
                progress(runner.spec)
        reference = done[baseline].tokens
        for spec in methods:
            done[spec].identical = done[spec].tokens == reference if greedy else None
            result.records.append(done[spec])
    return result


# -- rendering ---------------------------------------------------------------------------
def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None or value != value else pattern.format(value)


def render_tables(result: BenchResult, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    baseline = result.settings["baseline"]
    machine = result.machine
    title = (f"racer bench - {machine.get('cpu')}, {machine.get('threads')} threads, torch {machine.get('torch')}, "
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
            row["retrieval_share"] = sources.get("retrieval", 0) / sum(sources.values())
        rows.append(row)
    return rows


def write_plots(result: BenchResult, folder: str | os.PathLike) -> list[Path]:
    """PNGs: speedup per method per dataset, accepted-length histogram per method, and
    MAT against capacity when several capacities of one method were run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    methods = result.settings["methods"]
    rows = summarize(result.records, result.settings["baseline"])
    datasets = sorted({r.dataset for r in rows})
    written = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * len(datasets) / 2), 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r.speedup for r in rows if r.method == method and r.dataset == d), 0) for d in datasets]
        ax.bar(np.arange(len(datasets)) + i * width, values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2, datasets)
    ax.set_ylabel(f"speedup vs {result.settings['baseline']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "speedup.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        accepted = [a + 1 for r in result.records if r.method == method and r.accepted for a in r.accepted]
        if accepted:
            ax.hist(accepted, bins=np.arange(1, max(accepted) + 2) - 0.5, histtype="step", label=method, density=True)
    ax.set_xlabel("tokens emitted per verification step (1 + accepted)")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "accepted_hist.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    by_capacity: dict[str, list[tuple[int, float, str]]] = {}
    for r in rows:
        options = next(rec.options for rec in result.records if rec.method == r.method)
        if "capacity" in options and r.mat is not None and isinstance(options["capacity"], int):
            by_capacity.setdefault(options["method"], []).append((options["capacity"], r.mat, r.dataset))
    for name, points in by_capacity.items():
        if len({c for c, _, _ in points}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for dataset in sorted({d for _, _, d in points}):
            xs = sorted((c, m) for c, m, d in points if d == dataset)
            ax.plot([c for c, _ in xs], [m for _, m in xs], marker="o", label=dataset)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (draft nodes)")
        ax.set_ylabel("MAT")
        ax.set_title(name)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(folder / f"mat_vs_capacity_{name}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


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


def iter_questions(datasets: Iterable[str], limit: int | None) -> list[Any]:
    """Questions of each dataset; ``name:N`` overrides ``limit`` for that dataset."""
    from racer.data import load_questions

    out = []
    for entry in datasets:
        name, sep, count = entry.rpartition(":")
        if sep and count.isdigit():
            out.extend(load_questions(name, int(count)))
        else:
            out.extend(load_questions(entry, limit))
    return out


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
