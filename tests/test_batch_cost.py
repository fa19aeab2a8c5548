"""The cost of a batch's step (``racer.budget.batch_cost``), measured on batched passes
(``racer.engine.calibration.measure_batch``), and the budget's pause when drafts do not pay."""

from __future__ import annotations

import json
import random

import pytest

from racer.budget import AcceptanceModel, CostModel
from racer.budget.batch import BatchBudget
from racer.budget.batch_cost import BatchCostModel, PerNodeCurve, as_batch_cost, nodes_to_measure, rows_to_measure
from racer.engine.calibration import measure_batch
from racer.drafting.tree import DraftTree
from test_batch_budget import Fixed, wide_tree


def synthetic(rows: int, nodes: int, cached: int) -> float:
    """A pass: 10 ms, 1 ms a token in it, 2 us per cached position per row."""
    return 0.010 + 0.001 * rows * nodes + 2e-6 * cached * rows


def test_measured_tables_give_back_the_passes_they_timed():
    rows = rows_to_measure(6)
    assert rows == [1, 2, 3, 4, 6] and rows_to_measure(10) == [1, 2, 3, 4, 6, 8, 10]
    table = measure_batch(synthetic, rows, length=32, grown=192, repeats=2)
    assert table.rows == rows
    for r in rows:
        assert table.curves[r - 1 if r < 5 else 4].sizes == nodes_to_measure(r)
        for n in (1, 2, 8):
            for cached in (32, 400):
                assert table.pass_seconds(r, n, cached) == pytest.approx(synthetic(r, n, cached), rel=1e-6)
    # Between measured row counts: interpolated.
    assert table.pass_seconds(5, 4, 32) == pytest.approx(synthetic(5, 4, 32), rel=1e-6)


def test_the_step_adds_the_work_around_the_pass_and_drafting_only_when_drafting():
    table = measure_batch(synthetic, [1, 2, 4], repeats=1)
    for _ in range(50):  # each request's step work: 1 ms, of which drafting 0.4 ms
        table.refresh(4, 2, 32, synthetic(4, 2, 32), synthetic(4, 2, 32) + 0.004, 0.0016)
    assert table.overhead == pytest.approx(0.001, rel=1e-3) and table.drafting == pytest.approx(0.0004, rel=1e-3)
    assert table.predict(4, 2, 32) == pytest.approx(synthetic(4, 2, 32) + 0.004, rel=1e-3)
    assert table.predict(4, 1, 32, drafting=False) == pytest.approx(synthetic(4, 1, 32) + 0.0024, rel=1e-3)


def test_steps_of_one_row_count_teach_its_curve_and_scale_the_others():
    """Passes of 2 rows twice as slow as measured: that curve learns it; the others,
    unseen, follow part of the way (the machine may have slowed, or just that shape)."""
    table = measure_batch(synthetic, [1, 2, 4], repeats=1)
    before = [table.pass_seconds(r, 4, 32) for r in (1, 2, 4)]
    for _ in range(200):
        table.refresh(2, 4, 32, 2 * synthetic(2, 4, 32), 2 * synthetic(2, 4, 32))
    after = [table.pass_seconds(r, 4, 32) for r in (1, 2, 4)]
    assert after[1] == pytest.approx(2 * before[1], rel=0.02)
    ratios = [after[0] / before[0], after[2] / before[2]]
    assert ratios[0] == pytest.approx(ratios[1]) and 1.1 < ratios[0] < 1.9, ratios


def test_tables_round_trip_through_json():
    table = measure_batch(synthetic, [1, 2], repeats=1)
    table.kernel_table = CostModel([1, 8], [0.01, 0.02], 32, kernels=["model", "packed"])
    table.refresh(2, 2, 32, 0.02, 0.025, 0.001)
    again = BatchCostModel.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table and again.kernel_table.kernels == ["model", "packed"]
    with pytest.raises(ValueError, match="unknown format"):  # 1: before the packed kernel fused siblings
        BatchCostModel.from_json({**table.to_json(), "format": 1})
    with pytest.raises(ValueError, match="row counts"):
        BatchCostModel([2, 4], table.curves)


def test_a_single_request_curve_is_read_per_node():
    curve = CostModel([1, 64], [0.01, 0.64], length=0)
    batch = as_batch_cost(curve)
    assert isinstance(batch, PerNodeCurve) and batch.predict(4, 8, 0) == pytest.approx(curve.predict(32, 0))
    table = measure_batch(synthetic, [1], repeats=1)
    assert as_batch_cost(table) is table


def never_accepted() -> AcceptanceModel:
    model = AcceptanceModel()
    for _ in range(50):
        model.observe(wide_tree(), [0])
    return model


def test_drafting_pauses_while_drafts_do_not_pay_and_probes_again():
    table = measure_batch(synthetic, [1, 2, 4], repeats=1)
    for _ in range(20):
        table.refresh(4, 2, 32, synthetic(4, 2, 32), synthetic(4, 2, 32) + 0.004, 0.002)
    budget = BatchBudget(table)
    never = never_accepted()
    drafted = []
    for _ in range(40):
        if budget.drafts():
            drafted.append(True)
            kept = budget.select([wide_tree()] * 4, [never] * 4, [32] * 4)
            assert all(len(t) == 1 for t in kept)
        else:
            drafted.append(False)
    # Probes at steps 0, 2, 5, 10, 19, 36: each pause twice the last.
    assert [i for i, d in enumerate(drafted) if d] == [0, 2, 5, 10, 19, 36]


def test_one_request_whose_drafts_pay_in_bursts_drafts_every_step():
    """One step in four has a draft worth verifying: that step gains more than
    drafting costs in the other three, so drafting never pauses (a pause after each
    miss would skip the next burst)."""
    table = measure_batch(synthetic, [1, 2, 4], repeats=1)
    for _ in range(20):
        table.refresh(1, 2, 32, synthetic(1, 2, 32), synthetic(1, 2, 32) + 0.001, 0.0005)
    budget, never, sure = BatchBudget(table), Fixed(0.0), Fixed(0.95)
    for step in range(40):
        assert budget.drafts(), step
        kept = budget.select([wide_tree()], [sure if step % 4 == 0 else never], [32])
        if step % 4 == 0:
            assert len(kept[0]) > 1, step


def test_drafting_goes_on_while_drafts_pay():
    table = measure_batch(synthetic, [1, 2, 4], repeats=1)
    budget = BatchBudget(table)
    for _ in range(20):
        assert budget.drafts()
        kept = budget.select([wide_tree()] * 2, [Fixed(0.9)] * 2, [32] * 2)
        assert len(kept[0]) > 1
    assert budget.ask(64) == 2 * budget.last_cap + 8


def test_a_batch_decoder_measures_its_passes_once(tmp_path, monkeypatch):
    from conftest import make_tiny_llama
    from racer.engine.loop import BatchDecoder

    monkeypatch.setenv("RACER_CACHE", str(tmp_path))
    model = make_tiny_llama()
    said = []
    batch = BatchDecoder(model, None, "racer", max_batch=3, check=False)
    batch.calibrate(announce=said.append)
    assert isinstance(batch.cost, BatchCostModel) and batch.cost.rows == [1, 2, 3]
    assert batch.cost.kernel_table is not None and len(said) == 2
    assert all(s > 0 for curve in batch.cost.curves for s in curve.seconds)
    again = BatchDecoder(model, None, "racer", max_batch=3, check=False)
    again.calibrate(announce=said.append)
    assert len(said) == 2 and again.cost.rows == [1, 2, 3]  # read from the disk cache
    from racer import Decoder

    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    result = again.generate_all([prompt], max_new_tokens=8)[0]
    assert result.tokens == Decoder(model, None, "none").generate(prompt, max_new_tokens=8).tokens
