"""The decoding loop: limits, stops, streaming, statistics and bad input."""

import numpy as np
import pytest

from conftest import needs_cache_layers
from racer.drafting import Drafter, Needs, make_drafter
from racer.engine import Decoder, GenerationResult
from racer.drafting.tree import TreeBuilder

PROMPT = "List the numbers from one to twenty, separated by commas."


class RepeatDrafter(Drafter):
    """A test drafter that proposes a fixed branching tree, to exercise acceptance
    through branches and multi-token steps."""

    name = "repeat"
    needs = Needs(topk=4)
    candidates = 12

    def __init__(self):
        self.seen = []

    def begin(self, prompt, prompt_topk):
        self.last_topk = None

    def draft(self, root, budget):
        b = TreeBuilder(root, budget)
        if self.last_topk is not None:
            # top-2 guesses for the next token, then their top-1 chains.
            for rank in range(2):
                b.add_path([int(self.last_topk[rank]), int(self.last_topk[0])])
        b.add_path([root, root])
        return b.build()

    def observe(self, tree, tree_topk, accepted):
        assert tree_topk.shape == (len(tree), 4)
        self.seen.append(len(accepted))
        self.last_topk = tree_topk[accepted[-1]]


@pytest.mark.parametrize("limit", [1, 2, 7, 33])
def test_never_emits_past_max_new_tokens(real, limit):
    model, tok = real
    for method in ["none", "pld", RepeatDrafter()]:
        result = Decoder(model, tok, method).generate(PROMPT, chat=True, max_new_tokens=limit)
        assert len(result.tokens) == limit and result.stop_reason == "length"


def test_branching_drafter_is_lossless_and_accepts_multiple_tokens(real):
    model, tok = real
    plain = Decoder(model, tok, "none").generate(PROMPT, chat=True, max_new_tokens=60)
    drafter = RepeatDrafter()
    result = Decoder(model, tok, drafter).generate(PROMPT, chat=True, max_new_tokens=60)
    assert result.tokens == plain.tokens
    assert max(drafter.seen) > 1
    assert sum(s.accepted + 1 for s in result.steps) + 1 >= len(result.tokens)


def test_stop_string_cuts_right_after_the_completing_token(real):
    """The tokens end with the one that completed the stop string; the text, in
    ``generate`` and ``stream`` alike, stops before it (as the server's does)."""
    model, tok = real
    plain = Decoder(model, tok, "none").generate(PROMPT, chat=True, max_new_tokens=60)
    assert "5" in plain.text
    for method in ["none", "pld"]:
        result = Decoder(model, tok, method).generate(PROMPT, chat=True, max_new_tokens=60, stop=["5"])
        assert result.stop_reason == "stop"
        assert result.tokens == plain.tokens[: len(result.tokens)]
        assert "5" in tok.decode(result.tokens) and "5" not in tok.decode(result.tokens[:-1])
        assert result.text == plain.text[: plain.text.index("5")]
        streamed = GenerationResult.empty()
        pieces = list(Decoder(model, tok, method).stream(PROMPT, chat=True, max_new_tokens=60, stop=[", 24,"],
                                                         result=streamed))
        assert "".join(pieces) == streamed.text == plain.text[: plain.text.index(", 24,")]


def test_visible_text_holds_back_only_what_may_still_become_a_stop():
    from racer import visible_text

    assert visible_text("one, two, th", ["three"], final=False) == "one, two, "
    assert visible_text("one, two, th", ["three"], final=True) == "one, two, th"
    assert visible_text("one, two, three, four", ["three", "o, t"], final=False) == "one, tw"
    assert visible_text("one t", ["zz"], final=False) == "one t"
    assert visible_text("caf\ufffd", [], final=False) == "caf"  # a character whose other bytes are to come


def test_a_plain_string_is_a_user_message_when_the_model_has_a_template(real, tiny):
    """One rule for text, in the API and the CLI: through the chat template when the
    tokenizer has one, raw with chat=False (--raw)."""
    import copy

    from racer import encode_prompt

    _, tok = real
    text = "Name a colour."
    assert encode_prompt(tok, text) == encode_prompt(tok, [{"role": "user", "content": text}])
    assert encode_prompt(tok, text, chat=False) == tok(text, add_special_tokens=False).input_ids
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    assert encode_prompt(bare, text) == tok(text, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(bare, text, chat=True)
    with pytest.raises(ValueError, match="text needs a tokenizer"):
        Decoder(tiny, None, "none").generate(text)


def test_stream_yields_the_same_text_and_fills_statistics(real):
    model, tok = real
    decoder = Decoder(model, tok, "pld")
    result = GenerationResult(tokens=[], text="", prompt_tokens=0)
    pieces = list(decoder.stream(PROMPT, chat=True, max_new_tokens=40, result=result))
    assert "".join(pieces) == result.text and len(pieces) > 1
    assert result.passes == 1 + len(result.steps)
    assert result.mat == pytest.approx(len(result.tokens) / result.passes)
    assert all(s.tree_size >= 1 and s.verify_s > 0 and s.draft_s >= 0 for s in result.steps)


def test_mat_of_plain_decoding_is_one(real):
    model, tok = real
    result = Decoder(model, tok, "none").generate(PROMPT, chat=True, max_new_tokens=10)
    assert result.mat == 1.0 and len(result.steps) == 9


def test_stops_when_the_context_window_is_full(tiny):
    result = Decoder(tiny, None, "none").generate(list(range(1, 90)), max_new_tokens=50)
    assert result.stop_reason == "context" and 89 + len(result.tokens) == 96


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=PROMPT, max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=PROMPT, max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt=PROMPT, stop=[""]), "stop"),
    (dict(prompt=3.5), "prompt"),
])
def test_bad_input_names_the_argument(real, kwargs, pattern):
    model, tok = real
    with pytest.raises(ValueError, match=pattern):
        Decoder(model, tok, "none").generate(**kwargs)


def test_prompt_longer_than_the_context_window(real):
    model, tok = real
    too_long = [100] * model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context window"):
        Decoder(model, tok, "none").generate(too_long, max_new_tokens=1)


@pytest.mark.parametrize("spec, pattern", [("nope", "method"), ("pld:size=3", "option"), ("pld:max_ngram", "option"),
                                           ("pld:max_ngram=0", "pld")])
def test_unknown_method_or_option(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_drafter(spec)


def test_a_reused_result_keeps_nothing_of_the_last_request(tiny):
    decoder = Decoder(tiny, None, "none")
    fresh = decoder.generate([1, 2, 3], max_new_tokens=6)
    reused = GenerationResult.empty()
    for _ in range(2):
        list(decoder.stream([1, 2, 3], max_new_tokens=6, result=reused))
        assert reused.tokens == fresh.tokens and len(reused.steps) == len(fresh.steps)
        assert reused.prompt_tokens == 3 and reused.stop_reason == "length"


@needs_cache_layers
def test_fast_paths_switch_off_one_by_one_and_all_at_once(tiny):
    from transformers.cache_utils import DynamicLayer

    from racer.fastpaths import FastPaths

    plain = Decoder(tiny, None, "racer:capacity=8", fast_paths=False, cost=None)
    assert plain.verifier.tree_attention is None and plain.verifier.stack is None
    plain.calibrate(announce=None)
    assert {plain.verifier.kernel_of(n) for n in range(1, 65)} == {"model"}
    reference = plain.generate([5, 6, 7, 5, 6], max_new_tokens=20).tokens
    assert type(plain.verifier.cache.layers[0]) is DynamicLayer
    for switch in ("kernels", "tree_attention", "growing_cache", "packed_rows", "stack"):
        decoder = Decoder(tiny, None, "racer:capacity=8", fast_paths=FastPaths(**{switch: False}))
        assert decoder.generate([5, 6, 7, 5, 6], max_new_tokens=20).tokens == reference, switch
    with pytest.raises(ValueError, match="fast_paths"):
        Decoder(tiny, None, "none", fast_paths="fast")


def test_the_real_model_decodes_the_same_without_any_fast_path(real):
    model, tok = real
    fast = Decoder(model, tok, "racer").generate(PROMPT, chat=True, max_new_tokens=48)
    stock = Decoder(model, tok, "racer", fast_paths=False).generate(PROMPT, chat=True, max_new_tokens=48)
    assert stock.tokens == fast.tokens
    assert max(s.tree_size for s in stock.steps) > 1


def test_generation_options_are_one_value_for_generate_and_stream(real):
    from racer.engine import GenerationOptions

    model, tok = real
    decoder = Decoder(model, tok, "pld")
    options = GenerationOptions(max_new_tokens=12, chat=True)
    result = GenerationResult.empty()
    text = "".join(decoder.stream(PROMPT, options, result=result))
    assert decoder.generate(PROMPT, options).tokens == result.tokens and text == result.text
    assert len(decoder.generate(PROMPT, options, max_new_tokens=3).tokens) == 3
    with pytest.raises(TypeError, match="unexpected option max_tokens"):
        decoder.generate(PROMPT, max_tokens=3)


def test_end_ids_replace_the_models_end_tokens(tiny):
    from racer.engine import GenerationOptions

    decoder = Decoder(tiny, None, "pld", check=False)
    free = decoder.generate([5, 6, 7, 5, 6], max_new_tokens=20, end_ids=()).tokens
    assert len(free) == 20
    ended = decoder.generate([5, 6, 7, 5, 6], max_new_tokens=20, end_ids=[free[7]]).tokens
    assert ended == free[: free.index(free[7]) + 1]
    for bad in (["a"], [-1], 3, "2", [True]):
        with pytest.raises(ValueError, match="end_ids"):
            GenerationOptions(end_ids=bad)


@pytest.mark.parametrize("method, sampling", [("racer:capacity=16", {}), ("token-recycling", {}),
                                              ("racer:capacity=16", {"temperature": 0.8, "batched": True}),
                                              ("pld", {"repetition_penalty": 1.3}),
                                              ("logitspec", {"batched": True})])
def test_a_step_reads_the_device_once(tiny, method, sampling, monkeypatch):
    """What an accelerator needs: each verification step reads back one tensor (every
    node's chosen token beside the drafter's top-k), whatever the method. ``batched``:
    the chooser an accelerator gets (sampling draws every node at once, and a drafter
    that needs one row's top-k gets every row's in the same read)."""
    import functools

    import racer.engine.loop as looping
    import racer.engine.sampling as choosing
    from racer import Decoder

    sampling = dict(sampling)
    batched = sampling.pop("batched", None)
    monkeypatch.setattr(looping, "TokenChooser", functools.partial(looping.TokenChooser, batched=batched))
    reads = []
    for module in (looping, choosing):
        real_read = module.to_host
        monkeypatch.setattr(module, "to_host", lambda tensor, real_read=real_read: reads.append(1) or real_read(tensor))
    decoder = Decoder(tiny, None, method)
    decoder.calibrate()
    counted = []
    step = decoder.engine._verify

    def counting_step(*args):
        before = len(reads)
        out = step(*args)
        counted.append(len(reads) - before)
        return out

    decoder.engine._verify = counting_step
    decoder.generate([5, 17, 42, 8, 5, 17, 42, 8], max_new_tokens=24, seed=0, **sampling)
    assert counted and set(counted) == {1}, counted


def test_cpu_only_fast_paths_are_off_on_other_devices():
    from racer.fastpaths import FastPaths

    assert FastPaths().on("cpu") == FastPaths()
    assert FastPaths().on("cuda") == FastPaths(kernels=False, tree_attention=False, growing_cache=True,
                                               packed_rows=False, stack=False)
    assert FastPaths(growing_cache=False).on("cuda").growing_cache is False


def test_the_decoder_runs_the_batch_engine_with_one_row(tiny, monkeypatch):
    # One request is a batch of one: ``Decoder`` steps ``BatchDecoder``, on the row store
    # that keeps one request's own growing cache, and decodes what a batch decodes.
    from racer import BatchDecoder
    from racer.engine.rows import OneRow, SlotRows

    steps = []
    real_step = BatchDecoder.step
    monkeypatch.setattr(BatchDecoder, "step", lambda self: steps.append(self.max_batch) or real_step(self))
    prompt = [5, 17, 42, 8, 5, 17, 42, 8]
    decoder = Decoder(tiny, None, "racer:capacity=8")
    alone = decoder.generate(prompt, max_new_tokens=16)
    assert isinstance(decoder.engine, BatchDecoder) and isinstance(decoder.engine.rows, OneRow)
    assert steps and set(steps) == {1} and len(steps) >= len(alone.steps)
    batch = BatchDecoder(tiny, None, "racer:capacity=8", max_batch=2, check=False)
    assert isinstance(batch.rows, SlotRows)
    assert batch.generate_all([prompt, prompt[:5]], max_new_tokens=16)[0].tokens == alone.tokens
    # The decoder's drafter and acceptance model serve its next request too.
    pool = decoder.engine.memory.pool
    assert decoder.engine.idle_drafters == 1 and decoder.drafter is pool.peek(next(iter(pool.scopes())))[0]


class PromptRows(Drafter):
    """Records the prompt rows the engine hands over (``Needs.prompt``)."""

    name = "prompt-rows"
    needs = Needs(topk=3, prompt=True)
    candidates = 1

    def begin(self, prompt, prompt_topk):
        self.prompt, self.rows = list(prompt), prompt_topk

    def draft(self, root, budget):
        return TreeBuilder(root, budget).build()


@pytest.mark.parametrize("window", [0, 1, 5, 10_000])
def test_a_prompt_window_hands_the_drafter_the_prompts_last_rows(window):
    """Row i of ``prompt_topk`` is the prediction after the prompt's first
    ``len(prompt) - rows + i + 1`` tokens, for the last ``window`` positions (0: all),
    whether the prompt is prefilled in one pass or in chunks."""
    import torch

    from conftest import make_tiny_llama
    from racer import BatchDecoder

    model = make_tiny_llama()
    prompt = [5, 17, 42, 8, 5, 17, 9, 3, 21, 7, 14]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    expected = torch.topk(logits, 3, dim=-1).indices.numpy()
    for chunk in (64, 4):
        drafter = PromptRows()
        engine = BatchDecoder(model, None, drafter, max_batch=1, prefill_chunk=chunk, prompt_window=window)
        engine.generate_all([prompt], max_new_tokens=2)
        rows = len(prompt) if window in (0, 10_000) else window
        assert drafter.rows.shape == (rows, 3)
        assert (drafter.rows == expected[len(prompt) - rows :]).all()
    with pytest.raises(ValueError, match="prompt_window"):
        BatchDecoder(model, None, "none", prompt_window=-1)


class LatestPromptRows(PromptRows):
    """Reads only each prompt token's latest row (``Needs.prompt_rows``)."""

    needs = Needs(topk=3, prompt=True, prompt_rows="latest")


@pytest.mark.parametrize("window", [0, 5])
def test_latest_prompt_rows_are_computed_at_each_tokens_last_position_only(window):
    """With ``prompt_rows="latest"`` the rows at each token's latest position (within
    the rows handed over) are the model's predictions there and every other row is -1,
    in one pass or in chunks; a copy-logit table written from them is the table
    written from every row."""
    import torch

    from conftest import make_tiny_llama
    from racer import BatchDecoder
    from racer.drafting.copy_logit import CopyLogitTable

    model = make_tiny_llama()
    prompt = [5, 17, 42, 8, 5, 17, 9, 3, 21, 7, 5, 14, 5, 9]
    with torch.no_grad():
        expected = torch.topk(model(torch.tensor([prompt])).logits[0], 3, dim=-1).indices.numpy()
    rows = len(prompt) if window == 0 else window
    covered = prompt[len(prompt) - rows :]
    latest = [i for i, t in enumerate(covered) if t not in covered[i + 1 :]]
    for chunk in (64, 4):
        drafter = LatestPromptRows()
        BatchDecoder(model, None, drafter, max_batch=1, prefill_chunk=chunk, prompt_window=window).generate_all(
            [prompt], max_new_tokens=2)
        assert drafter.rows.shape == (rows, 3)
        assert (drafter.rows[latest] == expected[len(prompt) - rows :][latest]).all()
        others = [i for i in range(rows) if i not in latest]
        assert others and (drafter.rows[others] == -1).all()
        every, some = CopyLogitTable(3), CopyLogitTable(3)
        every.write(covered, expected[len(prompt) - rows :])
        some.write(covered, drafter.rows)
        assert some.rows == every.rows


def _prompt_tables(engine, prompts, max_new_tokens=2):
    """The ``prompt_topk`` each prompt's drafter began with, and (prompt ids, answer)
    pairs."""
    tables, begin, prompt_ids = [], engine.memory.begin, []

    def spy(scope, ids, prompt_topk):
        tables.append(prompt_topk)
        prompt_ids.append(list(ids))
        return begin(scope, ids, prompt_topk)

    engine.memory.begin = spy
    answers = [r.tokens for r in engine.generate_all(prompts, max_new_tokens=max_new_tokens)]
    return tables, list(zip(prompt_ids, answers))


def test_a_model_whose_head_is_not_its_output_embeddings_gets_its_own_logits_over_the_prompt():
    """The LM head after the first token is checked on the first prompt against the
    model's own last logits; where they disagree, or where the pass never went through
    the hooked module, that prompt's drafter sees one row and every later prompt gets
    the model's own logits at every position."""
    import torch

    from conftest import make_tiny_llama
    from racer import BatchDecoder

    model = make_tiny_llama()
    prompts = [[5, 17, 42, 8, 5, 17, 9, 3, 21, 7, 14], [3, 9, 27, 81, 5, 17, 42]]
    with torch.no_grad():
        expected = [torch.topk(model(torch.tensor([p])).logits[0], 3, dim=-1).indices.numpy() for p in prompts]
    trusted, _ = _prompt_tables(BatchDecoder(model, None, PromptRows(), max_batch=1), prompts)
    assert all(t.shape == (len(p), 3) and (t == e).all() for t, p, e in zip(trusted, prompts, expected))

    around = BatchDecoder(model, None, PromptRows(), max_batch=1)
    around.prompt_head.base = torch.nn.Linear(64, 64)  # a module the model's pass never calls
    (first, second), _ = _prompt_tables(around, prompts)
    assert around.prompt_head.trusted is False
    assert first.shape == (1, 3) and (first == expected[0][-1:]).all()
    assert second.shape == (len(prompts[1]), 3) and (second == expected[1]).all()

    wrong = torch.nn.Linear(64, 97, bias=False)
    model.get_output_embeddings = lambda: wrong
    engine = BatchDecoder(model, None, PromptRows(), max_batch=1)
    (first, second), _ = _prompt_tables(engine, prompts)
    assert engine.prompt_head.trusted is False
    assert first.shape == (1, 3) and (first == expected[0][-1:]).all()
    assert second.shape == (len(prompts[1]), 3) and (second == expected[1]).all()


def test_the_prompts_predictions_after_the_first_token_are_those_of_the_prefill_pass(real):
    """On the embedded model, racer's copy-logit table from the LM head run after the
    first token has left is the one the prefill pass itself gives, position by position,
    and the answers are plain greedy decoding's."""
    from conftest import hf_greedy, lossless_questions
    from racer import BatchDecoder

    model, tokenizer = real
    prompts = [q.prompt for q in lossless_questions()[:4]]
    engine = BatchDecoder(model, tokenizer, "racer", max_batch=1, check=False)
    engine.prompt_head.kernels = None  # the head on the model's own layer, as the pass computes it
    after, answers = _prompt_tables(engine, prompts, 8)
    in_pass = BatchDecoder(model, tokenizer, "racer", max_batch=1, check=False)
    in_pass.prompt_head.trusted = False
    during, _ = _prompt_tables(in_pass, prompts, 8)
    assert all(a.shape == d.shape and (a == d).all() for a, d in zip(after, during))
    assert all(a.shape[0] > 40 for a in after)
    # racer reads each token's latest row only: the others were never computed.
    for (ids, _), rows in zip(answers, after):
        computed = (rows[:, 0] >= 0).tolist()
        assert computed == [t not in ids[i + 1 :] for i, t in enumerate(ids)]
    assert len(answers) == len(prompts)
    assert all(answer == hf_greedy(model, ids, 8) for ids, answer in answers)


def test_the_prompt_head_on_packed_weights_ranks_as_the_models_layer(real):
    """Where the verifier built oneDNN-packed weights, the prompt's LM head runs on them:
    on the embedded model over real prompts, its top ids are the model layer's at every
    position except where the layer's own logits nearly tie at the ranks that differ
    (rounding of another summation order), and no kept row differs at all in most
    prompts."""
    import torch

    from conftest import lossless_questions
    from racer.engine.options import GenerationOptions, request_ids
    from racer.engine.prompt_head import PromptHead
    from racer.fastpaths.kernels import LinearKernels, packed_weights

    model, tokenizer = real
    if packed_weights(model) is None:
        pytest.skip("no oneDNN-packed weights on this machine")
    kernels = LinearKernels(model)
    packed, plain = PromptHead(model, kernels), PromptHead(model)
    used = []
    using = kernels.using
    kernels.using = lambda kernel: used.append(kernel) or using(kernel)
    differing = rows = 0
    for question in lossless_questions()[:6]:
        ids = request_ids(tokenizer, question.prompt, GenerationOptions(), 8192)
        with torch.inference_mode(), plain.capture() as hidden:
            last = model(torch.tensor([ids]), logits_to_keep=1).logits[0]
            ours = packed.top_ids(hidden[0], last, 8)
            theirs = plain.top_ids(hidden[0], last, 8)
            logits = model.lm_head(hidden[0])
        for position in (ours != theirs).any(axis=1).nonzero()[0]:
            ranked = torch.sort(logits[position], descending=True).values
            first = int((ours[position] != theirs[position]).nonzero()[0][0])
            assert float(ranked[first] - ranked[first + 1]) < 1e-3 * float(ranked[0].abs())
            differing += 1
        rows += len(ids)
    assert used and set(used) == {"hybrid"}
    assert packed.trusted and differing <= rows // 1000 + 1


def _bad_needs():
    return [dict(topk=3, prompt=True, prompt_rows="first"), dict(topk=3, prompt=True, prompt_rows=None)]


@pytest.mark.parametrize("fields", _bad_needs())
def test_needs_names_a_bad_prompt_rows(fields):
    with pytest.raises(ValueError, match="prompt_rows"):
        Needs(**fields)


def test_latest_positions_and_spread():
    from racer.engine.prompt_head import latest_positions, spread

    assert latest_positions([3, 1, 3, 2, 1]).tolist() == [2, 3, 4]
    assert latest_positions([7]).tolist() == [0]
    rows = spread(np.array([[1, 2], [3, 4]]), np.array([1, 3]), 4)
    assert rows.tolist() == [[-1, -1], [1, 2], [-1, -1], [3, 4]]
