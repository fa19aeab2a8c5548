"""The benchmark: it calls racer's public API only (measure.py times the engine's parts)."""

from racer.bench.plots import write_plots
from racer.bench.questions import DATASETS, Question, load_questions
from racer.bench.report import BenchResult, Record, Summary, load, merge, render_tables, save, summarize
from racer.bench.runner import HF_METHODS, iter_questions, run_bench

__all__ = ["BenchResult", "DATASETS", "HF_METHODS", "Question", "Record", "Summary", "iter_questions",
           "load", "load_questions", "merge", "render_tables", "run_bench", "save", "summarize", "write_plots"]
