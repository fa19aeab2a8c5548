"""Per-token provenance: which draft source proposed each emitted token, and the step
that emitted it; on the real model for racer, pld and none, alone and in a batch, and
as tinted character runs (``racer.TokenSpans``)."""

from __future__ import annotations

import pytest

from racer import BatchDecoder, Decoder, Method, TokenSpans, parse_method
from racer.drafting.logitspec import LogitSpecDrafter
from racer.drafting.racer import RacerDrafter
from racer.drafting.tree import LOGITS, RETRIEVAL, TreeBuilder, source_name

CODE = [{"role": "user", "content": "Write a Python class Stack with push, pop, peek and is_empty methods, "
                                    "then a Queue class with the same methods built on two stacks."}]
WORDS = [{"role": "user", "content": "Repeat after me five times: the quick brown fox jumps over the lazy dog."}]


class Recording:
    """Wraps a drafter: keeps every verified tree with the path the step accepted."""

    def __init__(self, drafter) -> None:
        self.inner, self.steps = drafter, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def observe(self, tree, topk, accepted) -> None:
        self.steps.append((tree, list(accepted)))
        self.inner.observe(tree, topk, accepted)


def check(result, steps) -> None:
    """Every token tagged, the last of each step "none", each accepted draft token
    tagged with the sources of the node it came from, counts adding up."""
    assert len(result.token_sources) == len(result.tokens) == len(result.token_steps)
    assert result.token_steps[0] == 0 and result.token_sources[0] == "none"
    assert result.token_steps == sorted(result.token_steps)
    assert sum(result.provenance.values()) == len(result.tokens)
    assert len(steps) == len(result.steps)
    for number, (tree, path) in enumerate(steps, start=1):
        tagged = [s for s, n in zip(result.token_sources, result.token_steps) if n == number]
        expected = [source_name(tree.sources[i]) if tree.sources else "none" for i in path[1:]] + ["none"]
        assert tagged == expected[: len(tagged)], number
        # Only the last step may be cut short (by the token limit or an end token).
        assert len(tagged) == len(expected) or number == len(steps)
        assert all(s != "none" for s in tagged[: len(path) - 1])


@pytest.mark.parametrize("method", ["racer", "pld", "none"])
def test_every_token_is_tagged_with_the_source_of_its_accepted_node(real, method):
    model, tokenizer = real
    spec = parse_method(method)
    recording = Recording(spec.drafter)
    decoder = Decoder(model, tokenizer, Method(recording, spec.capacity))
    plain = Decoder(model, tokenizer, "none").generate(CODE, max_new_tokens=96)
    result = decoder.generate(CODE, max_new_tokens=96)
    assert result.tokens == plain.tokens
    check(result, recording.steps)
    drafted = {s for s in result.token_sources if s != "none"}
    if method == "none":
        assert result.provenance["none"] == len(result.tokens)
    elif method == "pld":
        assert drafted == {"retrieval"}  # prompt lookup retrieves, nothing else
    else:
        assert drafted and drafted <= {"retrieval", "logits", "both"}
        # One model's token a pass (the last pass may be cut before it by the token limit).
        assert result.passes - 1 <= result.provenance["none"] <= result.passes


def test_a_batch_tags_each_request_as_it_would_be_tagged_alone(real):
    model, tokenizer = real
    alone = Decoder(model, tokenizer, "racer:capacity=16")
    results_alone = [alone.generate(p, max_new_tokens=64) for p in (CODE, WORDS)]
    batch = BatchDecoder(model, tokenizer, "racer:capacity=16", max_batch=2)
    results = batch.generate_all([CODE, WORDS], max_new_tokens=64)
    for result, single in zip(results, results_alone):
        assert result.tokens == single.tokens
        assert len(result.token_sources) == len(result.tokens) == len(result.token_steps)
        assert sum(result.provenance.values()) == len(result.tokens)
        # The model's own token ends every pass (the last may be cut before it by the limit).
        last = {}
        for source, step in zip(result.token_sources, result.token_steps):
            last[step] = source
        assert len(last) == result.passes and sorted(last) == list(range(result.passes))
        assert {last[step] for step in range(result.passes - 1)} == {"none"}
    assert any(r.provenance["retrieval"] + r.provenance["both"] > 0 for r in results)


def test_spans_cover_the_text_and_tint_each_character_by_its_token(real):
    model, tokenizer = real
    result = Decoder(model, tokenizer, "racer").generate(WORDS, max_new_tokens=80)
    spans = TokenSpans.of(tokenizer, result)
    assert spans.text == result.text
    assert "".join(spans.pieces()) == result.text
    runs = spans.spans()
    assert sum(length for length, _, _ in runs) == len(result.text)
    at = 0
    for piece, source, step in zip(spans.pieces(), result.token_sources, result.token_steps):
        for length, run_source, run_step in spans.spans(at, at + len(piece)):
            assert (run_source, run_step) == (source, step)
        at += len(piece)
    # Any cut of the text is covered exactly too (a stream's chunks).
    assert sum(n for n, _, _ in spans.spans(5, 17)) == 12


def test_a_character_split_over_tokens_belongs_to_the_token_that_completes_it(real):
    _, tokenizer = real
    ids = tokenizer.encode("ok 🦊 fox", add_special_tokens=False)
    assert len(ids) > len("ok 🦊 fox".split())  # the emoji takes more than one token here
    spans = TokenSpans(tokenizer)
    spans.add(ids, ["retrieval"] * len(ids), 1)
    pieces = spans.pieces()
    assert spans.text == "ok 🦊 fox" and "".join(pieces) == spans.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum("🦊" in piece for piece in pieces) == 1
    holder = next(i for i, piece in enumerate(pieces) if "🦊" in piece)
    assert "\ufffd" not in tokenizer.decode(ids[: holder + 1]) and "\ufffd" in tokenizer.decode(ids[:holder])


def test_a_node_both_sources_propose_is_tagged_both():
    builder = TreeBuilder(0, 8)
    builder.add_path([5, 6], RETRIEVAL)
    builder.add_child(0, 5, LOGITS)  # the copy-logit table proposes the same first token
    builder.add_child(0, 7, LOGITS)
    tree = builder.build()
    names = {tree.tokens[i]: source_name(tree.sources[i]) for i in range(1, len(tree))}
    assert names == {5: "both", 6: "retrieval", 7: "logits"}
    assert source_name(tree.sources[0]) == "none"


def test_racer_tags_a_retrieved_token_its_copy_logit_row_also_holds_as_both():
    import numpy as np

    drafter = RacerDrafter(n=4, k=2)  # n-grams of up to 4 tokens: this short context fills them
    drafter.attach(None, set())
    context = [1, 2, 3, 4, 1, 2]  # the root 3 then repeats "1 2 3": retrieval proposes 4, 1, 2
    topk = np.array([[9, 8]] * len(context))
    topk[2] = [4, 9]  # after token 3 the model predicted 4: copy-logit row(3) holds the retrieved 4
    drafter.begin(context, topk)
    tree = drafter.draft(3, 8)
    by_path = {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]): source_name(tree.sources[i])
               for i in range(1, len(tree))}
    assert by_path[(4,)] == "both"
    assert by_path[(4, 1)] == "retrieval"
    assert by_path[(9,)] == "logits"  # row(3)'s other guess, from the table alone


def test_logitspec_tags_its_guess_logits_and_what_it_retrieved_after_retrieval():
    import numpy as np

    drafter = LogitSpecDrafter()
    drafter.attach(None, set())
    context = [4, 6, 7, 1, 2, 3, 4, 5, 1, 2, 3]
    drafter.begin(context, np.array([[6, 8, 9]]))
    tree = drafter.draft(4, 16)
    names = {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]): source_name(tree.sources[i])
             for i in range(1, len(tree))}
    assert names[(5,)] == "retrieval"  # the root's own chain: "3 4" was followed by 5
    assert names[(6,)] == "logits"  # a guess from the last logits
    assert names[(6, 7)] == "retrieval"  # what followed "4 6" in the context
