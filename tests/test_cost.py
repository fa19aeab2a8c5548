"""Measuring the step-cost curve on a model, caching it on disk, and capacity=auto in
the decoding loop."""

import time

import numpy as np
import pytest

from conftest import LOSSLESS_NEW_TOKENS, hf_greedy, make_tiny_llama
from racer.engine.calibration import cost_file, load_or_measure, measure
from racer.budget.cost import CostModel
from racer.budget import DraftBudget, WholeTree
from racer.drafting import RacerDrafter, parse_method
from racer.engine import Decoder, encode_prompt
from racer.fastpaths import KERNELS


def test_measure_times_every_size_that_fits(tiny):
    model = measure(tiny, sizes=(1, 2, 4, 8), length=8, grown=16, repeats=1)
    assert model.sizes == [1, 2, 4, 8] and all(s > 0 for s in model.seconds)
    assert model.per_position >= 0 and model.per_position_node >= 0
    assert len(model.kernels) == 4 and set(model.kernels) <= set(KERNELS)  # each size keeps its fastest kernel


def test_measure_keeps_the_kernel_that_prefilled_a_prompt_fastest(monkeypatch):
    from racer.engine import calibration

    model = make_tiny_llama()
    model.config.max_position_embeddings = 1024  # room for a prompt of PREFILL tokens
    real_prefill = calibration.TreeVerifier.prefill
    widths = []

    def prefill(verifier, ids, keep=1):
        if len(ids) > 64:  # a prompt pass, not a tree's context: slow on every kernel but one
            widths.append(len(ids))
            if verifier.kernel_of(len(ids)) != "weight_major":
                time.sleep(0.02)
        return real_prefill(verifier, ids, keep)

    monkeypatch.setattr(calibration.TreeVerifier, "prefill", prefill)
    table = measure(model, sizes=(1, 2, 4), length=8, grown=0, repeats=2)
    assert table.prefill_size == calibration.PREFILL and set(widths) == {calibration.PREFILL}
    assert table.prefill_kernel == "weight_major" and table.kernel(4096) == "weight_major"
    model.config.max_position_embeddings = 64  # no prompt fits beside the trees: nothing measured
    assert measure(model, sizes=(1, 2), length=8, grown=0, repeats=1).prefill_size == 0


def test_timing_says_how_far_it_is_and_how_long_is_left(tiny, monkeypatch):
    from racer.engine import calibration

    heard: list[str] = []
    progress = calibration.Progress(heard.append, "timing", total=4, every=0.0)
    for _ in range(4):
        progress.tick()
    progress.close()
    assert heard[:3] == [line for line in heard[:3] if line.startswith("timing: ") and "s left" in line]
    assert [line.split("(")[1].split(" ")[0] for line in heard[:3]] == ["1/4", "2/4", "3/4"]
    assert len(heard) == 4 and heard[-1].startswith("timing: done in")
    # The first measurement announces itself, then its progress (every few seconds:
    # here every pass), then that it is done.
    monkeypatch.setenv("RACER_COST_CACHE", "0")
    monkeypatch.setattr(calibration.Progress, "EVERY", 0.0)
    heard.clear()
    load_or_measure(tiny, announce=heard.append)
    assert heard[0].startswith("timing verification passes of 1-") and "not saved" in heard[0]
    assert any("% (" in line and "about" in line for line in heard[1:-1])
    assert heard[-1].startswith("timing verification passes: done in")


def test_measure_times_the_long_cache_within_the_same_shuffled_rounds(tiny, monkeypatch):
    # The growth terms are differences between a short and a long cache; timed minutes
    # apart they would measure the machine's drift instead.
    from racer.engine import verifier as verify

    seen = []
    original = verify.TreeVerifier.verify

    def spy(self, tree):
        seen.append(self.cached)
        return original(self, tree)

    monkeypatch.setattr(verify.TreeVerifier, "verify", spy)
    measure(tiny, sizes=(1, 2, 4, 8), length=8, grown=16, repeats=2)
    far = [i for i, cached in enumerate(seen) if cached == 24]
    near = [i for i, cached in enumerate(seen) if cached == 8]
    assert len(far) >= 2 * 2  # sizes 1 and 8 in each of 2 rounds, with every kernel on offer
    assert any(min(far) < i < max(far) for i in near)  # interleaved, not one block after the other


def test_the_decoder_verifies_with_the_kernel_the_table_chose(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    table = CostModel([1, 2, 4, 8], [0.01, 0.011, 0.012, 0.02], length=8,
                      kernels=["model", "weight_major", "weight_major", "packed"])
    kernels = Decoder(tiny, None, "pld", cost=table).verifier.kernel_of
    assert [kernels(n) for n in range(1, 10)] == ["model"] + ["weight_major"] * 5 + ["packed"] * 3
    assert Decoder(tiny, None, "racer:capacity=8", cost=Frozen(0.0)).verifier.kernel_of(8) == "model"
    assert Decoder(tiny, None, "none").verifier.kernel_of(8) == "model"
    Decoder(tiny, None, "none").generate([1, 2, 3], max_new_tokens=2)
    assert not (tmp_path / "costs").exists()  # plain decoding measures nothing
    decoder = Decoder(tiny, None, "pld")
    assert not (tmp_path / "costs").exists()  # constructing a decoder never measures
    announced = []
    decoder.calibrate(announce=announced.append)
    assert cost_file(tiny).exists()  # any drafter that drafts measures (once) which kernel is faster
    assert len(announced) == 1 and "timing verification passes" in announced[0]
    Decoder(tiny, None, "pld").calibrate(announce=announced.append)
    assert len(announced) == 1  # read from the cache: nothing to announce


def test_prompts_prefill_on_the_kernel_the_table_chose_for_them(tiny, monkeypatch):
    from racer.fastpaths.kernels import LinearKernels

    table = CostModel([1, 2, 4, 8], [0.01, 0.011, 0.012, 0.02], length=8, kernels=["model"] * 4,
                      prefill_size=32, prefill_kernel="weight_major")
    used = []
    real_using = LinearKernels.using
    monkeypatch.setattr(LinearKernels, "using", lambda self, kernel: used.append(kernel) or real_using(self, kernel))
    prompt = [int(t) for t in np.random.default_rng(3).integers(tiny.config.vocab_size, size=40)]
    decoder = Decoder(tiny, None, "pld", cost=table, check=False)
    out = decoder.generate(prompt, max_new_tokens=40)  # within the tiny model's 96 positions
    assert used[0] == "weight_major" and "weight_major" not in used[1:]  # the prompt, then trees of <= 8
    assert out.tokens == hf_greedy(tiny, prompt, 40)


def test_cost_is_cached_per_model_and_hardware(tmp_path, monkeypatch):
    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.delenv("RACER_COST_CACHE", raising=False)
    model = make_tiny_llama(seed=1)
    first = load_or_measure(model)
    assert cost_file(model).exists() and first.path == str(cost_file(model))
    first.seconds[0] = 123.0
    first.save()
    assert load_or_measure(model).seconds[0] == 123.0  # read back, not measured again
    assert load_or_measure(model, refresh=True).seconds[0] != 123.0
    other = make_tiny_llama(seed=1).to(dtype=__import__("torch").bfloat16)
    assert cost_file(other) != cost_file(model)  # dtype is part of the key
    from racer.engine import calibration

    isa = calibration.cpu_info()
    monkeypatch.setattr(calibration, "cpu_info", lambda: {**isa, "isa": isa["isa"] + ["another-extension"]})
    other_cpu = cost_file(model)
    monkeypatch.setattr(calibration, "cpu_info", lambda: isa)
    assert other_cpu != cost_file(model)  # another CPU generation of the same name: another table
    cost_file(model).write_text("{not json")
    assert load_or_measure(model).seconds[0] > 0  # a damaged file is measured again


def test_capacity_auto_is_the_default_for_every_tree_drafter(tmp_path):
    for spec in ("racer", "token-recycling", "logitspec"):
        method = parse_method(spec)
        assert method.auto and method.describe()["capacity"] == "auto", spec
        fixed = parse_method(spec + ":capacity=16")
        assert not fixed.auto and fixed.capacity == 16 and fixed.describe()["capacity"] == 16
    for bad in ("racer:capacity=big", "token-recycling:capacity=0", "logitspec:capacity=-3", "pld:capacity=0"):
        with pytest.raises(ValueError, match="capacity: expected 'auto' or a node count"):
            parse_method(bad)
    assert parse_method("pld").capacity == 11 and parse_method("none").capacity == 1
    assert not parse_method("none").drafts and parse_method("pld").drafts


def test_capacity_is_one_option_of_the_decoder_and_the_spec(tiny):
    assert Decoder(tiny, None, RacerDrafter(), capacity=8, cost=Frozen(0.0)).method.capacity == 8
    assert isinstance(Decoder(tiny, None, "racer", cost=Frozen(0.0)).budget, DraftBudget)
    assert isinstance(Decoder(tiny, None, "racer:capacity=8", cost=Frozen(0.0)).budget, WholeTree)
    with pytest.raises(ValueError, match="capacity: given twice"):
        Decoder(tiny, None, "racer:capacity=8", capacity=16)


class Frozen:
    """A cost curve that step timings do not move (a GPU-like flat one, or a steep one)."""

    def __init__(self, per_node: float) -> None:
        self.per_node = per_node

    def predict(self, nodes, cached):
        return 0.05 + self.per_node * (nodes - 1)

    def refresh(self, nodes, cached, seconds):
        pass


def test_flat_cost_verifies_the_whole_candidate_tree_and_steep_shrinks_it(real):
    model, tokenizer = real
    prompt = "Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape."
    flat = Decoder(model, tokenizer, "racer", cost=Frozen(0.0)).generate(prompt, max_new_tokens=48, chat=True)
    steep = Decoder(model, tokenizer, "racer", cost=Frozen(0.05)).generate(prompt, max_new_tokens=48, chat=True)
    assert all(s.tree_size == s.candidates for s in flat.steps)
    assert max(s.candidates for s in flat.steps) > 16
    assert all(s.tree_size <= s.candidates for s in steep.steps)
    assert np.mean([s.tree_size for s in steep.steps]) < 0.5 * np.mean([s.tree_size for s in flat.steps])
    assert flat.tokens == steep.tokens


@pytest.mark.parametrize("method", ["racer", "token-recycling", "logitspec"])
def test_auto_capacity_on_the_real_model_is_lossless_and_learns(real, method):
    model, tokenizer = real
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "Write a Python function that returns the "
                                     "squares of a list, then explain it."}], chat=True)
    decoder = Decoder(model, tokenizer, method)
    result = decoder.generate(ids, max_new_tokens=LOSSLESS_NEW_TOKENS)
    assert result.tokens == hf_greedy(model, ids, LOSSLESS_NEW_TOKENS)
    sizes = {s.tree_size for s in result.steps}
    assert len(sizes) > 1  # the budget chose per step
    assert sum(t for _, t in decoder.acceptance.counts.values()) > 0  # kept for the decoder's next request


def test_one_save_policy_for_one_row_and_many(tmp_path, monkeypatch):
    # A table the engine read or measured learns from its steps and is saved back once
    # nothing is in flight, with one row or many; a curve handed in stays the caller's.
    import json

    from racer import BatchDecoder
    from racer.budget.batch_cost import BatchCostModel

    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    monkeypatch.delenv("RACER_COST_CACHE", raising=False)
    model = make_tiny_llama(seed=3)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    for engine in (Decoder(model, None, "racer", check=False).engine,
                   BatchDecoder(model, None, "racer", max_batch=2, check=False)):
        engine.calibrate(announce=None)
        saved = json.loads(open(engine.cost.path, encoding="utf-8").read())
        engine.generate_all([prompt, prompt[:6]][: engine.max_batch], max_new_tokens=12)
        assert json.loads(open(engine.cost.path, encoding="utf-8").read()) != saved  # refreshed, saved
        assert json.loads(open(engine.cost.path, encoding="utf-8").read()) == engine.cost.to_json()
    given = CostModel([1, 2, 4, 8], [1e-3, 1.1e-3, 1.2e-3, 2e-3], length=8, path=str(tmp_path / "mine.json"))
    decoder = Decoder(model, None, "racer", cost=given, check=False)
    decoder.generate(prompt, max_new_tokens=12)
    assert given.seconds == [1e-3, 1.1e-3, 1.2e-3, 2e-3] and not (tmp_path / "mine.json").exists()
    assert decoder.cost is not given and decoder.cost.seconds != given.seconds  # the engine's own copy learnt
    batch = BatchDecoder(model, None, "racer", max_batch=2, cost=given, check=False)
    batch.generate_all([prompt], max_new_tokens=6)
    assert given.seconds == [1e-3, 1.1e-3, 1.2e-3, 2e-3] and not isinstance(batch.cost, BatchCostModel)
