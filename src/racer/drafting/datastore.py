"""REST's datastore: a tokenised corpus and its suffix array, built once by
``racer datastore build`` and memory-mapped at run time.

On disk (one folder): ``tokens.npy`` (uint32; documents separated by ``SEPARATOR``,
which no pattern contains, so no match or continuation crosses a document),
``suffixes.npy`` (the suffix array, from pydivsufsort) and ``meta.json`` (which
tokenizer built it, so a mismatched model is refused).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

FORMAT = 1
SEPARATOR = np.iinfo(np.uint32).max
_FILES = ("tokens.npy", "suffixes.npy", "meta.json")


class DatastoreError(ValueError):
    """A datastore that is missing, malformed or built for another tokenizer."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (token text -> id): two tokenizers with the
    same fingerprint give the same ids for the same text pieces."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: (item[1], item[0])):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def write_datastore(documents: Iterable[Sequence[int]], out: str | Path, *, tokenizer: str,
                    fingerprint: str, sources: Sequence[str] = ()) -> dict:
    """Write token-id documents as a datastore folder; returns its metadata."""
    from pydivsufsort import divsufsort

    pieces: list[np.ndarray] = []
    count = 0
    for doc in documents:
        ids = np.asarray(doc, dtype=np.int64)
        if not len(ids):
            continue
        if ids.min() < 0 or ids.max() >= SEPARATOR:
            raise DatastoreError(f"document {count}: token ids must lie in [0, {SEPARATOR})")
        pieces += [ids.astype(np.uint32), np.array([SEPARATOR], dtype=np.uint32)]
        count += 1
    if not count:
        raise DatastoreError("corpus: expected at least one non-empty document, got none")
    tokens = np.concatenate(pieces)
    if len(tokens) >= 2**31 - 1:
        raise DatastoreError(f"corpus: {len(tokens)} tokens exceed the suffix array's limit of 2^31 - 1")
    start = time.perf_counter()
    suffixes = divsufsort(tokens).astype(np.int32, copy=False)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "tokens.npy", tokens)
    np.save(folder / "suffixes.npy", suffixes)
    meta = {"format": FORMAT, "tokenizer": tokenizer, "fingerprint": fingerprint, "documents": count,
            "tokens": int(len(tokens) - count), "sources": list(sources)[:1000],
            "suffix_array_s": round(time.perf_counter() - start, 3)}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# -- reading a corpus --------------------------------------------------------------------
def _texts_from_value(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (a chat transcript's turns included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts_from_value(item)
    elif isinstance(value, dict):
        for key in ("value", "content", "text"):
            if key in value:
                yield from _texts_from_value(value[key])
                return


def corpus_files(paths: Sequence[str | Path], pattern: str = "*", exclude: Sequence[str] = ()) -> list[Path]:
    """Files named, and files under folders named (recursively, matching ``pattern``,
    skipping any whose path below the folder has a part matching an ``exclude`` pattern)."""
    from fnmatch import fnmatch

    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files += sorted(p for p in path.rglob(pattern) if p.is_file() and not any(
                fnmatch(part, ex) for part in p.relative_to(path).parts for ex in exclude))
        elif path.is_file():
            files.append(path)
        else:
            raise DatastoreError(f"corpus: {entry} is neither a file nor a folder")
    if not files:
        raise DatastoreError(f"corpus: no files found in {', '.join(map(str, paths))} (pattern {pattern!r})")
    return files


def corpus_texts(files: Sequence[Path], field: str = "text") -> Iterator[str]:
    """Documents: one per JSONL line (the strings in ``field``), one per other file.
    Files that are not UTF-8 text are skipped."""
    for path in files:
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if path.suffix == ".jsonl":
            for number, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatastoreError(f"corpus: {path}:{number}: not JSON ({err.msg})") from None
                if not isinstance(record, dict) or field not in record:
                    raise DatastoreError(f"corpus: {path}:{number}: expected an object with a {field!r} field "
                                         "(choose the field with --field)")
                text = "\n".join(_texts_from_value(record[field]))
                if text.strip():
                    yield text
        elif raw.strip():
            yield raw


def build_datastore(paths: Sequence[str | Path], tokenizer: Any, out: str | Path, *, field: str = "text",
                    pattern: str = "*", exclude: Sequence[str] = (), name: str | None = None,
                    batch: int = 256) -> dict:
    """Tokenise a corpus (JSONL with a text field, or text files, or folders of them)
    with ``tokenizer`` and write the datastore to ``out``."""
    files = corpus_files(paths, pattern, exclude)

    def documents() -> Iterator[list[int]]:
        chunk: list[str] = []
        for text in corpus_texts(files, field):
            chunk.append(text)
            if len(chunk) == batch:
                yield from tokenizer(chunk, add_special_tokens=False).input_ids
                chunk = []
        if chunk:
            yield from tokenizer(chunk, add_special_tokens=False).input_ids

    return write_datastore(documents(), out, tokenizer=name or tokenizer_name(tokenizer),
                           fingerprint=tokenizer_fingerprint(tokenizer), sources=[str(f) for f in files])


class Datastore:
    """A datastore folder, memory-mapped."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        missing = [name for name in _FILES if not (self.folder / name).is_file()]
        if missing:
            raise DatastoreError(f"datastore: {self.folder} lacks {', '.join(missing)}; build one with "
                                 "'racer datastore build CORPUS... --out DIR'")
        self.meta = json.loads((self.folder / "meta.json").read_text())
        if self.meta.get("format") != FORMAT:
            raise DatastoreError(f"datastore: {self.folder} has format {self.meta.get('format')!r}, "
                                 f"this racer reads format {FORMAT}; rebuild it")
        self.tokens = np.load(self.folder / "tokens.npy", mmap_mode="r")
        self.suffixes = np.load(self.folder / "suffixes.npy", mmap_mode="r")
        if len(self.tokens) != len(self.suffixes) or self.tokens.dtype != np.uint32:
            raise DatastoreError(f"datastore: {self.folder}: tokens and suffix array do not match; rebuild it")

    def __len__(self) -> int:
        return len(self.tokens)

    def check_tokenizer(self, tokenizer: Any) -> None:
        mine = tokenizer_fingerprint(tokenizer)
        if mine != self.meta["fingerprint"]:
            raise DatastoreError(
                f"datastore: {self.folder} was built with tokenizer {self.meta['tokenizer']!r} "
                f"(fingerprint {self.meta['fingerprint']}), but the model's tokenizer {tokenizer_name(tokenizer)!r} "
                f"has fingerprint {mine}; rebuild it with --model set to this model")

    def _compare(self, rank: int, pattern: np.ndarray) -> int:
        """Sign of (suffix at ``rank``, cut to len(pattern)) minus ``pattern``."""
        start = int(self.suffixes[rank])
        piece = self.tokens[start : start + len(pattern)].astype(np.int64)
        differ = np.flatnonzero(piece != pattern[: len(piece)])
        if len(differ):
            return 1 if piece[differ[0]] > pattern[differ[0]] else -1
        return -1 if len(piece) < len(pattern) else 0

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """Suffix-array ranks [lo, hi) of the suffixes that start with ``pattern``."""
        pattern = np.asarray(pattern, dtype=np.int64)
        lo, hi = 0, len(self.suffixes)
        while lo < hi:  # first rank >= pattern
            mid = (lo + hi) // 2
            if self._compare(mid, pattern) < 0:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.suffixes) or self._compare(lo, pattern) != 0:
            return lo, lo  # absent: no need for the upper bound
        first, hi = lo, len(self.suffixes)
        while lo < hi:  # first rank > pattern
            mid = (lo + hi) // 2
            if self._compare(mid, pattern) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def continuations(self, lo: int, hi: int, offset: int, length: int) -> np.ndarray:
        """(hi - lo, length) int64: the ``length`` tokens starting ``offset`` after each
        suffix in [lo, hi); SEPARATOR past a document's end."""
        starts = np.asarray(self.suffixes[lo:hi], dtype=np.int64) + offset
        index = starts[:, None] + np.arange(length)
        inside = index < len(self.tokens)
        out = np.asarray(self.tokens[np.minimum(index, len(self.tokens) - 1)], dtype=np.int64)
        out[~inside] = SEPARATOR
        return out
