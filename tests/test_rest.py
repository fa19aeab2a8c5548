"""REST: the datastore (suffix array search, continuations, tokenizer check), the top
prefixes by count, the drafted tree, and `racer datastore build`."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from racer.cli import main
from racer.drafting.datastore import SEPARATOR, Datastore, DatastoreError, build_datastore, write_datastore
from racer.drafting import make_drafter, parse_method
from racer.drafting.rest import RestDrafter, top_prefixes


def store(tmp_path, docs, name="ds") -> str:
    write_datastore(docs, tmp_path / name, tokenizer="test", fingerprint="f")
    return str(tmp_path / name)


def test_top_prefixes_by_count_then_shorter_then_smaller():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]])
    # counts: (1) 3, (1 2) 2, then 1 each: (7) before any 2-token prefix, (1 5) before (7 8)
    assert top_prefixes(rows, 4) == [(1,), (1, 2), (7,), (1, 5)]
    assert top_prefixes(rows, 0) == []


def test_top_prefixes_stop_at_a_document_end():
    rows = np.array([[3, SEPARATOR, 4], [3, 5, SEPARATOR]])
    assert top_prefixes(rows, 10) == [(3,), (3, 5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=5),
       st.lists(st.integers(0, 4), min_size=1, max_size=4))
def test_find_counts_every_occurrence_within_documents(tmp_path_factory, docs, pattern):
    folder = store(tmp_path_factory.mktemp("ds"), docs)
    ds = Datastore(folder)
    lo, hi = ds.find(pattern)
    m = len(pattern)
    brute = sum(doc[i : i + m] == pattern for doc in docs for i in range(len(doc) - m + 1))
    assert hi - lo == brute
    for start in ds.suffixes[lo:hi]:
        assert ds.tokens[start : start + m].tolist() == pattern


def test_draft_uses_the_longest_suffix_with_a_hit(tmp_path):
    d = RestDrafter(datastore=store(tmp_path, [[1, 2, 3, 4], [9, 2, 3, 5], [2, 3, 4, 6]]))
    d.begin([0, 2], None)
    # context + root = (0, 2, 3): (0 2 3) unseen, (2 3) three times -> 4 | 5 | 4 6
    tree = d.draft(3, 100)
    assert tree.tokens == (3, 4, 5, 6) and tree.parents == (-1, 0, 0, 1)
    d.begin([9, 2], None)  # (9 2 3) once -> 5 (end of its document)
    assert d.draft(3, 100).tokens == (3, 5)
    assert d.matched == [3]


def test_min_suffix_and_capacity(tmp_path):
    folder = store(tmp_path, [[5, 1, 2, 3, 4, 5, 6]])
    method = parse_method(f"rest:datastore={folder}:capacity=3")
    d, size = method.drafter, method.draft_size
    d.begin([7, 7], None)
    assert d.draft(5, size).tokens == (5,)  # only (5) matches: 1 token is below min_suffix 2
    d.begin([4], None)
    assert d.draft(5, size).tokens == (5, 6)
    d.begin([5], None)
    assert d.draft(1, size).tokens == (1, 2, 3)  # capacity 3 nodes, root included


def test_observe_keeps_the_context_tail(tmp_path):
    d = RestDrafter(datastore=store(tmp_path, [[1, 2, 3, 4]]), max_suffix=3)
    d.begin([8, 8, 8, 8], None)
    tree = d.draft(1, 10)  # (8 8 1)/(8 1) unseen; 1 alone is below min_suffix
    assert tree.tokens == (1,)
    d.observe(tree, None, [0])
    assert d.draft(2, 10).tokens == (2, 3, 4)
    assert d._tail == [8, 8, 1]


def test_missing_or_foreign_datastore_is_refused(tmp_path, real):
    with pytest.raises(ValueError, match="datastore"):
        make_drafter("rest")
    with pytest.raises(DatastoreError, match="racer datastore build"):
        make_drafter(f"rest:datastore={tmp_path / 'nothing'}")
    from racer import Decoder

    model, tokenizer = real
    foreign = make_drafter(f"rest:datastore={store(tmp_path, [[1, 2, 3]])}")
    with pytest.raises(DatastoreError, match="fingerprint"):
        Decoder(model, tokenizer, foreign, check=False)


def test_build_from_text_and_jsonl_with_the_real_tokenizer(tmp_path, real):
    _, tokenizer = real
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "corpus" / "skip.bin").write_bytes(b"\xff\xfe\x00binary")
    chats = [{"text": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
             {"text": "Plain line."}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    meta = build_datastore([tmp_path / "corpus", tmp_path / "chat.jsonl"], tokenizer, tmp_path / "ds")
    assert meta["documents"] == 3
    ds = Datastore(tmp_path / "ds")
    ds.check_tokenizer(tokenizer)  # the same tokenizer passes
    docs = [tokenizer.decode(part.tolist()) for part in np.split(ds.tokens, np.flatnonzero(ds.tokens == SEPARATOR))]
    assert docs[0] == "def add(a, b):\n    return a + b\n"
    assert docs[1] == "Hi there\nHello!" and docs[2] == "Plain line."
    # A Python function continues as the corpus does.
    ids = tokenizer("    return a", add_special_tokens=False).input_ids
    d = RestDrafter(datastore=str(tmp_path / "ds"))
    d.attach(tokenizer, set())
    d.begin(ids[:-1], None)
    assert tokenizer.decode(list(d.draft(ids[-1], 10).tokens)) == " a + b\n"


def test_build_errors_name_the_problem(tmp_path, real):
    _, tokenizer = real
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DatastoreError, match=r"bad.jsonl:1.*'text' field"):
        build_datastore([bad], tokenizer, tmp_path / "ds")
    with pytest.raises(DatastoreError, match="neither a file nor a folder"):
        build_datastore([tmp_path / "absent"], tokenizer, tmp_path / "ds")


def test_cli_builds_a_datastore(tmp_path, capsys, real):
    (tmp_path / "a.md").write_text("The quick brown fox jumps over the lazy dog.")
    assert main(["datastore", "build", str(tmp_path / "a.md"), "--out", str(tmp_path / "ds")]) == 0
    assert "1 documents" in capsys.readouterr().out
    assert main(["datastore", "build", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "corpus" in err and "Traceback" not in err


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=20))
def test_longest_suffix_is_the_one_trying_16_down_to_2_finds(tmp_path_factory, docs, context):
    d = RestDrafter(datastore=store(tmp_path_factory.mktemp("ds"), docs))

    def occurs(pattern):
        return any(doc[i : i + len(pattern)] == pattern for doc in docs for i in range(len(doc)))

    expected = next((n for n in range(min(16, len(context)), 1, -1) if occurs(context[-n:])), 0)
    d.retrieve(context, 8)
    assert d.matched == [expected]
