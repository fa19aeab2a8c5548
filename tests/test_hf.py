"""racer from Hugging Face ``generate``: ``custom_generate=racer.hf.generate`` and the
repository's ``custom_generate/`` folder return exactly what ``generate`` returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (LogitsProcessorList, NoRepeatNGramLogitsProcessor, StoppingCriteria,
                          StoppingCriteriaList, TextIteratorStreamer, TextStreamer)
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.streamers import BaseStreamer
from transformers.generation.stopping_criteria import StopStringCriteria

import racer.hf
from conftest import make_tiny_llama
from families import FAMILIES, METHODS as FAMILY_METHODS, NEW_TOKENS, build, known, prompts, shared_cost
from test_lossless import datastore  # noqa: F401  (a fixture)
from test_sampling import RUNS, TINY_PROMPT, TINY_SHAPE, chi2, chi2_critical, exact_distribution

REPO = Path(__file__).resolve().parents[1]
METHODS = ["none", "pld", "racer", "racer:capacity=16:memory=fresh", "token-recycling", "logitspec",
           "rest:datastore={datastore}"]
QUESTIONS = ["Write a Python function that returns the n-th Fibonacci number, with a docstring.",
             "List the planets of the solar system in order, one per line."]


def chat(tokenizer, questions: list[str]) -> dict:
    """A left-padded batch of chat prompts (one prompt: no padding)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def plain(model, **kwargs):
    with torch.inference_mode():
        return model.generate(**kwargs)


def ours(model, method: str = "racer", **kwargs):
    with torch.inference_mode():
        return model.generate(custom_generate=racer.hf.generate, racer_method=method, **kwargs)


GREEDY = dict(do_sample=False, top_p=None, top_k=None, temperature=None)


@pytest.fixture(scope="module")
def greedy_answers(real):
    model, tokenizer = real
    return [(chat(tokenizer, [q]), plain(model, **chat(tokenizer, [q]), max_new_tokens=96, **GREEDY))
            for q in QUESTIONS]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_returns_generates_tensor_for_every_method(real, greedy_answers, method, datastore):  # noqa: F811
    model, _ = real
    method = method.format(datastore=datastore)
    for inputs, want in greedy_answers:
        got = ours(model, method, **inputs, max_new_tokens=96, **GREEDY)
        assert torch.equal(got, want), method


def test_a_left_padded_batch_decodes_each_row_as_alone(real):
    model, tokenizer = real
    questions = ["Say hi.", QUESTIONS[0], "What is 17 times 23? Answer with the number only."]
    batch = chat(tokenizer, questions)
    assert len({int(m.sum()) for m in batch["attention_mask"]}) == 3  # three prompt lengths
    got = ours(model, "racer", **batch, max_new_tokens=64, **GREEDY)
    width = batch["input_ids"].shape[1]
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad
    alone = [plain(model, **chat(tokenizer, [q]), max_new_tokens=64, **GREEDY) for q in questions]
    longest = max(a.shape[1] - chat(tokenizer, [q])["input_ids"].shape[1] for a, q in zip(alone, questions))
    assert got.shape == (3, width + longest)
    assert torch.equal(got[:, :width], batch["input_ids"])
    for row, (question, one) in enumerate(zip(questions, alone)):
        new = one[0, chat(tokenizer, [question])["input_ids"].shape[1]:].tolist()
        assert got[row, width:].tolist() == new + [pad] * (longest - len(new)), question
    assert any(len(one[0]) < width + longest for one in alone)  # a row really ended early and was padded


class Pieces(TextStreamer):
    """A TextStreamer that keeps the pieces it would print."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)


def test_the_streamer_gets_the_same_pieces_as_generates_loop(real):
    model, tokenizer = real
    inputs = chat(tokenizer, ["Write two short lines about the sea, then a line of Japanese: 海と空。"])
    want, got = Pieces(tokenizer), Pieces(tokenizer)
    plain(model, **inputs, max_new_tokens=80, streamer=want, **GREEDY)
    ours(model, "racer", **inputs, max_new_tokens=80, streamer=got, **GREEDY)
    assert got.pieces == want.pieces and len(want.pieces) > 3
    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = ours(model, "pld", **inputs, max_new_tokens=80, streamer=iterator, **GREEDY)
    assert "".join(iterator) == "".join(want.pieces)
    assert "".join(want.pieces) == tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_a_batch_streams_one_token_per_row_per_position_as_generate_does(real):
    model, tokenizer = real
    batch = chat(tokenizer, ["Say hi.", "Count from one to ten in words."])
    recorder = Recorder()
    out = ours(model, "racer", **batch, max_new_tokens=40, streamer=recorder, **GREEDY)
    width = batch["input_ids"].shape[1]
    assert recorder.puts[0] == batch["input_ids"].reshape(-1).tolist()  # generate put the prompt
    assert [column for column in recorder.puts[1:]] == out[:, width:].T.tolist()
    assert recorder.ended


def test_stop_strings_and_max_length(real, tmp_path):
    model, tokenizer = real
    inputs = chat(tokenizer, [QUESTIONS[1]])
    length = inputs["input_ids"].shape[1]
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, ["Mars", "\n\n"])])
    want = plain(model, **inputs, max_new_tokens=96, stop_strings=["Mars", "\n\n"], tokenizer=tokenizer, **GREEDY)
    assert want.shape[1] < length + 96  # the stop string ended it
    assert torch.equal(ours(model, "racer", **inputs, max_new_tokens=96, stopping_criteria=criteria, **GREEDY), want)
    folder = model.generate(**inputs, max_new_tokens=96, stop_strings=["Mars", "\n\n"], tokenizer=tokenizer,
                            custom_generate=str(REPO), trust_remote_code=True, **GREEDY)
    assert torch.equal(folder, want)
    want = plain(model, **inputs, max_length=length + 17, **GREEDY)
    assert want.shape[1] == length + 17
    assert torch.equal(ours(model, "racer", **inputs, max_length=length + 17, **GREEDY), want)


def test_several_end_tokens_end_a_row_where_generate_ends_it(real):
    model, tokenizer = real
    inputs = chat(tokenizer, [QUESTIONS[1]])
    free = plain(model, **inputs, max_new_tokens=64, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    comma = free[10]  # a token the answer emits: as an end token it ends the row there
    eos = model.generation_config.eos_token_id
    ends = (eos if isinstance(eos, list) else [eos]) + [comma]
    want = plain(model, **inputs, max_new_tokens=64, eos_token_id=ends, **GREEDY)
    assert want[0, -1] == comma and want.shape[1] <= inputs["input_ids"].shape[1] + 11
    assert torch.equal(ours(model, "racer", **inputs, max_new_tokens=64, eos_token_id=ends, **GREEDY), want)


def test_max_time_ends_every_row_with_a_prefix_of_the_answer(real):
    model, tokenizer = real
    inputs = chat(tokenizer, [QUESTIONS[0]])
    full = plain(model, **inputs, max_new_tokens=64, **GREEDY)
    cut = ours(model, "none", **inputs, max_new_tokens=64, max_time=0.0, **GREEDY)
    assert inputs["input_ids"].shape[1] < cut.shape[1] < full.shape[1]
    assert torch.equal(cut[0], full[0, : cut.shape[1]])


def test_the_folder_form_loads_and_gives_the_same_output(real):
    model, tokenizer = real
    inputs = chat(tokenizer, [QUESTIONS[0]])
    want = plain(model, **inputs, max_new_tokens=64, **GREEDY)
    got = model.generate(**inputs, max_new_tokens=64, custom_generate=str(REPO), trust_remote_code=True,
                         racer_method="pld", return_dict_in_generate=True, **GREEDY)
    assert isinstance(got, GenerateDecoderOnlyOutput) and torch.equal(got.sequences, want)
    assert got.scores is None and got.past_key_values is None
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(**inputs, max_new_tokens=8, custom_generate=str(REPO), **GREEDY)


def test_repetition_penalty_as_generate_applies_it(real):
    model, tokenizer = real
    inputs = chat(tokenizer, ["List the numbers one to twenty in words."])
    want = plain(model, **inputs, max_new_tokens=48, repetition_penalty=1.3, **GREEDY)
    assert torch.equal(ours(model, "racer", **inputs, max_new_tokens=48, repetition_penalty=1.3, **GREEDY), want)


@pytest.mark.parametrize("method", ["none", "racer:capacity=16"])
def test_sampling_through_generate_is_exactly_distributed(method):
    """The first three tokens of ``generate(do_sample=True, ...)`` through racer follow
    the model's processed distribution (enumerated exactly), run after run."""
    model = make_tiny_llama(seed=3)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    probs, _ = exact_distribution(model, TINY_PROMPT, 3, **TINY_SHAPE)
    ids = torch.tensor([TINY_PROMPT])
    counts: dict[tuple, int] = {}
    for seed in range(RUNS):
        torch.manual_seed(seed)
        out = ours(model, method, input_ids=ids, max_new_tokens=3, do_sample=True, top_p=None, **TINY_SHAPE)
        key = tuple(out[0, len(TINY_PROMPT):].tolist())
        counts[key] = counts.get(key, 0) + 1
    stat, df = chi2(counts, probs, RUNS)
    assert stat < chi2_critical(df), (method, stat, df)


def test_sampling_is_repeatable_with_torch_manual_seed_and_copies_rows(real):
    model, tokenizer = real
    inputs = chat(tokenizer, [QUESTIONS[1]])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(ours(model, "racer", **inputs, max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.95,
                         num_return_sequences=3))
    assert runs[0].shape[0] == 3 and torch.equal(runs[0], runs[1])
    assert len({tuple(row.tolist()) for row in runs[0]}) > 1  # three draws, not one copied


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.refused is None][::3], ids=lambda f: f.label)
def test_family_matrix_models_through_generate(family, monkeypatch):
    """Every third family of the matrix, every method of the matrix, on its short prompt
    and on the one longer than its attention window."""
    import racer.engine.loop as looping

    if not known(family):
        pytest.skip("not in this transformers")
    # What a tiny model's pass costs is not under test (as in the matrix): one made-up table.
    monkeypatch.setattr(looping, "load_or_measure", lambda *args, **kwargs: shared_cost())
    model = build(family)
    for ids in prompts(int(model.config.vocab_size)).values():
        tensor = torch.tensor([ids], device=next(model.parameters()).device)
        kwargs = dict(input_ids=tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=NEW_TOKENS, **GREEDY)
        want = plain(model, **kwargs)
        for method in FAMILY_METHODS:
            assert torch.equal(ours(model, method, **kwargs), want), method


def test_a_model_racer_cannot_verify_is_refused():
    from racer import UnsupportedModelError

    family = next(f for f in FAMILIES if f.refused is not None and known(f))
    model = build(family)
    tensor = torch.tensor([prompts(int(model.config.vocab_size))["short"]])
    with pytest.raises(UnsupportedModelError):
        ours(model, "racer:capacity=64", input_ids=tensor, max_new_tokens=4, **GREEDY)


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_beams=2), "num_beams"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(output_logits=True, return_dict_in_generate=True), "output_logits"),
    (dict(no_repeat_ngram_size=3), "NoRepeatNGramLogitsProcessor"),
    (dict(logits_processor=LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)])), "NoRepeatNGramLogitsProcessor"),
    (dict(min_new_tokens=5), "MinLengthLogitsProcessor|MinNewTokensLengthLogitsProcessor"),
    (dict(stopping_criteria=StoppingCriteriaList([Never()])), "Never"),
    (dict(prompt_lookup_num_tokens=4), "prompt_lookup_num_tokens"),
    (dict(do_sample=True, min_p=0.1), "MinPLogitsWarper"),
    (dict(racer_method="nonsense"), "method"),
])
def test_what_racer_cannot_do_is_refused_by_name(real, kwargs, name):
    model, tokenizer = real
    inputs = chat(tokenizer, ["Say hi."])
    args = dict(GREEDY, max_new_tokens=8)
    args.update(kwargs)
    method = args.pop("racer_method", "racer")
    with pytest.raises(ValueError, match=name):
        ours(model, method, **inputs, **args)


def test_an_assistant_model_and_embeddings_are_refused(real):
    model, tokenizer = real
    inputs = chat(tokenizer, ["Say hi."])
    with pytest.raises(ValueError, match="assistant_model"):
        ours(model, "racer", **inputs, max_new_tokens=8, assistant_model=model, **GREEDY)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(ValueError, match="input_ids"):
        ours(model, "racer", inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=8,
             **GREEDY)
