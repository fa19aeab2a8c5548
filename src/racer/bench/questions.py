"""Benchmark questions: Spec-Bench, HumanEval, MGSM-ZH, code editing, agent sessions (shipped
with the package, in ``racer/bench/data``; licences in its README), or any JSONL of the
same formats: ``{"question_id", "category", "turns": [...]}`` (the first turn is the
question), or ``{"question_id", "category", "messages": [...]}``, a replayed conversation
in which every user message the assistant answers next is a request carrying all the
messages before it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("spec_bench", "human_eval", "mgsm", "code_edit", "agent_sessions")


@dataclass(frozen=True)
class Question:
    dataset: str
    category: str
    question_id: str
    prompt: str  # the first turn, or a session's last message
    messages: tuple[dict[str, str], ...] = ()  # a session's conversation up to this request
    session: str | None = None  # requests of one session share it and go in order

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.category}/{self.question_id}"

    @property
    def chat(self) -> list[dict[str, str]]:
        """The chat messages this request sends."""
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.prompt}]


def data_dir() -> Path:
    """$RACER_DATA if set, else the questions shipped inside the package."""
    if os.environ.get("RACER_DATA"):
        return Path(os.environ["RACER_DATA"])
    return Path(__file__).resolve().parent / "data"


def load_questions(dataset: str, limit: int | None = None) -> list[Question]:
    """Questions of ``dataset`` (a name in DATASETS or a JSONL path); ``limit`` keeps
    the first N of each category (of a sessions file: the first N sessions of each)."""
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
                category = str(record.get("category", name))
                question_id = str(record.get("question_id", number))
                if "messages" in record:
                    found = _session(name, category, question_id, record["messages"])
                else:
                    turns = record["turns"]
                    found = [Question(name, category, question_id, turns[0] if isinstance(turns, list) else turns)]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as err:
                raise ValueError(f"dataset {path}: line {number} is not a question with 'turns' or a session "
                                 f"with 'messages' ({type(err).__name__}: {err})") from None
            if limit is not None and taken.get(category, 0) >= limit:
                continue
            taken[category] = taken.get(category, 0) + 1
            questions.extend(found)
    return questions


def _session(dataset: str, category: str, question_id: str, messages: list) -> list[Question]:
    """A session's requests: one per user message, with every message before it."""
    for message in messages:
        if message.get("role") not in ("system", "user", "assistant") or not isinstance(message.get("content"), str):
            raise TypeError(f"expected messages of role system, user or assistant with text content, got {message!r}")
    chat = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    asks = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if not asks:
        raise IndexError("a session needs at least one user message")
    return [Question(dataset, category, f"{question_id}/{turn}", chat[i]["content"], chat[: i + 1], question_id)
            for turn, i in enumerate(asks, 1)]
