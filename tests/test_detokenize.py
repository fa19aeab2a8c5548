"""Incremental detokenisation: the pieces given out as tokens come join to exactly the
whole answer's ``tokenizer.decode``, across characters split over tokens, tokenizers
whose decoding of a prefix is not a prefix of the whole, and stop strings of several
tokens; and it decodes each token a bounded number of times (linear, not quadratic)."""

from __future__ import annotations

import copy
import random

import pytest

from racer import Detokenizer, StopText, TokenSpans
from racer.engine.stopping import cut_at_stop

TEXTS = [
    "Plain words, then numbers: 3.14159 and 2,718.",
    "Accents: café, naïve, Ångström; CJK: 日本語のテキスト, 中文; emoji: 🚀🎉👩‍💻 and ✓.",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code\n\n\ttabs\tand  double  spaces",
    "I do n't know . Is it ? Yes , it 's fine ! They 're here , we 've seen ' it ' .",
]


@pytest.fixture(scope="module")
def tokenizer(real):
    return real[1]


@pytest.fixture(scope="module")
def cleaning(tokenizer):
    """The same tokenizer cleaning up spaces: ``" ."`` decodes to ``"."``, so the decoding
    of a prefix is not a prefix of the whole's."""
    cleaner = copy.deepcopy(tokenizer)
    cleaner.clean_up_tokenization_spaces = True
    # transformers applies the clean-up to a BPE tokenizer only when told to.
    cleaner.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = cleaner("do n't .", add_special_tokens=False)["input_ids"]
    whole = cleaner.decode(ids, skip_special_tokens=True)
    assert whole == "don't." and not whole.startswith(cleaner.decode(ids[:2]))  # "do n"
    return cleaner


def streamed(tokenizer, ids: list[int], rng: random.Random) -> tuple[str, list[str]]:
    """The pieces a Detokenizer gives for ``ids`` handed over in random steps of 1-6."""
    detokenizer, pieces, i = Detokenizer(tokenizer), [], 0
    while i < len(ids):
        step = rng.randint(1, 6)
        pieces.append(detokenizer.add(ids[i : i + step]))
        i += step
    pieces.append(detokenizer.finish())
    assert "".join(pieces) == detokenizer.text
    return detokenizer.text, pieces


@pytest.mark.parametrize("which", ["byte_level", "cleaning_up_spaces"])
def test_streamed_text_is_the_whole_decode(tokenizer, cleaning, which):
    tok = tokenizer if which == "byte_level" else cleaning
    rng = random.Random(7)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(5):
            whole, pieces = streamed(tok, ids, rng)
            assert whole == tok.decode(ids, skip_special_tokens=True)
            # Nothing given out ends in part of a character.
            assert not any(piece.endswith("\ufffd") for piece in pieces)


@pytest.mark.parametrize("which", ["byte_level", "cleaning_up_spaces"])
def test_random_token_sequences_stream_to_their_decode(tokenizer, cleaning, which):
    """Token ids drawn at random (many are pieces of multi-byte characters) and special
    tokens in between, which decoding skips."""
    tok = tokenizer if which == "byte_level" else cleaning
    rng = random.Random(11)
    specials = sorted(set(tok.all_special_ids))
    for _ in range(40):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(60)]
        assert streamed(tok, ids, rng)[0] == tok.decode(ids, skip_special_tokens=True)


def test_decoding_is_linear_in_the_answers_length(tokenizer):
    decoded = []

    class Counting:
        clean_up_tokenization_spaces = False

        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer(" ".join(TEXTS) * 20, add_special_tokens=False)["input_ids"]
    detokenizer = Detokenizer(Counting())
    for token in ids:
        detokenizer.add([token])
    detokenizer.finish()
    assert detokenizer.text == tokenizer.decode(ids)
    assert len(ids) > 1000 and sum(decoded) < 12 * len(ids)  # a whole decode per token would be ~n²/2


@pytest.mark.parametrize("stops", [["fine !"], ["日本語"], ["🎉👩"], [" ?", "xyz"], ["never there"]])
def test_stop_strings_of_several_tokens_are_cut_and_never_shown(tokenizer, stops):
    rng = random.Random(3)
    text = TEXTS[1] + " " + TEXTS[3]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for _ in range(5):
        detokenizer, visible, shown, i = Detokenizer(tokenizer), StopText(stops), [], 0
        while i < len(ids):
            step = rng.randint(1, 4)
            piece = visible.add(detokenizer.add(ids[i : i + step]))
            shown.append(piece)
            # What is shown never holds a stop string, nor begins one that is still open.
            assert not any(s in visible.shown for s in stops)
            i += step
        shown.append(visible.add(detokenizer.finish(), final=True))
        expected, stopped = cut_at_stop(tokenizer.decode(ids), stops)
        assert "".join(shown) == visible.shown == expected
        assert visible.stopped == stopped


def test_token_spans_cover_the_decoded_text(tokenizer):
    from racer import GenerationResult

    ids = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    result = GenerationResult(tokens=ids, text="", prompt_tokens=0, token_sources=["retrieval", "none"] * len(ids),
                              token_steps=list(range(len(ids))))
    spans = TokenSpans.of(tokenizer, result)
    assert spans.text == tokenizer.decode(ids)
    assert sum(run[0] for run in spans.spans()) == len(spans.text)
    assert "".join(spans.pieces()) == spans.text
