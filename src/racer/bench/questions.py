"""Benchmark questions: Spec-Bench, HumanEval, MGSM-ZH, code editing (shipped with the package, in
``racer/bench/data``; licences in its README), or any JSONL of the same format
(``{"question_id", "category", "turns": [...]}``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("spec_bench", "human_eval", "mgsm", "code_edit")


@dataclass(frozen=True)
class Question:
    dataset: str
    category: str
    question_id: str
    prompt: str  # the first turn

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.category}/{self.question_id}"


def data_dir() -> Path:
    """$RACER_DATA if set, else the questions shipped inside the package."""
    if os.environ.get("RACER_DATA"):
        return Path(os.environ["RACER_DATA"])
    return Path(__file__).resolve().parent / "data"


def load_questions(dataset: str, limit: int | None = None) -> list[Question]:
    """Questions of ``dataset`` (a name in DATASETS or a JSONL path); ``limit`` keeps
    the first N of each category."""
    if dataset in DATASETS:
        path, name = data_dir() / f"{dataset}.jsonl", dataset
        if not path.is_file():
            raise ValueError(f"dataset {dataset}: {path} is missing (RACER_DATA={os.environ.get('RACER_DATA')!r}); "
                             f"expected a folder holding {', '.join(f'{d}.jsonl' for d in DATASETS)}")
    else:
        path, name = Path(dataset), Path(dataset).stem
        if not path.is_file():
            raise ValueError(f"dataset: expected one of {', '.join(DATASETS)} or a JSONL file, got {dataset!r}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit: expected a positive integer, got {limit}")
    taken: dict[str, int] = {}
    questions = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record["turns"]
                prompt = turns[0] if isinstance(turns, list) else turns
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                raise ValueError(f"dataset {path}: line {number} is not a question with 'turns' ({err})") from None
            category = str(record.get("category", name))
            if limit is not None and taken.get(category, 0) >= limit:
                continue
            taken[category] = taken.get(category, 0) + 1
            questions.append(Question(name, category, str(record.get("question_id", number)), prompt))
    return questions
