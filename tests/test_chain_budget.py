"""The chain budget: the floor a verified draft token must clear, from timed steps."""

from __future__ import annotations

import random

import pytest

from racer.budget.chain import ChainBudget


def steps(budget: ChainBudget, per_row: float, per_token: float, n: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        rows, drafted = rng.randint(1, 8), rng.randint(0, 40)
        budget.observe(rows, drafted, rows * 2, 0.02 + per_row * rows + per_token * drafted)


def test_the_floor_is_the_cost_of_a_token_times_the_rate_it_must_beat():
    budget = ChainBudget(window=256)
    steps(budget, per_row=0.004, per_token=0.001)
    assert budget.cost_per_token() == pytest.approx(0.001, rel=1e-6)  # told apart from the rows' cost
    data = list(budget.steps)
    rate = sum(s[2] for s in data) / sum(s[3] for s in data)
    assert budget.floor() == pytest.approx(0.001 * rate, rel=1e-6)
    free = ChainBudget()
    steps(free, per_row=0.004, per_token=0.0)
    assert free.floor() == pytest.approx(0.0, abs=1e-9)  # tokens that cost nothing are all worth verifying


def test_the_floor_follows_the_recent_steps():
    budget = ChainBudget(window=64)
    steps(budget, per_row=0.004, per_token=0.0001)
    cheap = budget.floor()
    steps(budget, per_row=0.004, per_token=0.002, seed=1)  # e.g. a larger batch on the same machine
    assert budget.floor() > 5 * cheap


def test_the_floor_before_the_steps_can_tell_is_the_one_given():
    budget = ChainBudget(warmup=32)
    steps(budget, per_row=0.004, per_token=0.001, n=31)
    assert budget.floor() == 0.0 and budget.cost_per_token() is None
    prior = ChainBudget(warmup=32, before=0.3)
    steps(prior, per_row=0.004, per_token=0.001, n=31)
    assert prior.floor() == 0.3
    steps(prior, per_row=0.004, per_token=0.001, n=1)
    assert prior.floor() != 0.3  # measured from the 32nd step on
    with pytest.raises(ValueError, match="before"):
        ChainBudget(before=1.5)
    same = ChainBudget()
    for _ in range(100):  # the same draft size every step: its cost is not separable from the rows'
        same.observe(4, 20, 8, 0.05)
    assert same.cost_per_token() is None and same.floor() == 0.0
    budget.observe(0, 0, 0, 0.1)  # an empty step is not a sample
    budget.observe(2, 3, 4, 0.0)
    assert len(budget.steps) == 31
    with pytest.raises(ValueError):
        ChainBudget(window=2)
