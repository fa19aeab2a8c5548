"""What a step of a batch costs: one pass over ``rows`` trees of ``nodes`` nodes each
(padded to the largest, or packed: then ``nodes`` is the trees' mean size), on caches
whose longest row holds ``cached`` tokens, plus the per-request work around the pass
(drafting, choosing, accepting). Pure Python (no torch).

Measured on batched passes (``racer.engine.calibration.measure_batch``), not derived
from single-request passes: a batched pass attends every row to its own cache and pays
for the longest, builds a mask per row, and its matmul of ``rows x nodes`` rows need
not cost what a single tree of as many nodes does. One ``CostModel`` per measured row
count gives the pass time by nodes per row; row counts in between are interpolated.
Refreshed from real steps: the machine's speed moves every curve, the curve of the
row count seen learns its shape, and the work around the pass is a running mean per
request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from racer.budget.cost import CostModel, _write_json, bracket

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
NODES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MOST_TOKENS = 256  # a row count's sizes stop where a pass would exceed this many tokens
# Raised whenever what a table's numbers mean changes; tables of another format are measured
# again (2: the packed kernel computes sibling layers as one product).
FORMAT = 2


def rows_to_measure(max_batch: int) -> list[int]:
    """Every row count up to 8, then the usual steps, and ``max_batch`` itself."""
    rows = [r for r in ROWS if r <= max_batch]
    return rows if rows[-1] == max_batch else rows + [max_batch]


def nodes_to_measure(rows: int) -> list[int]:
    return [n for n in NODES if n == 1 or rows * n <= MOST_TOKENS]


@dataclass
class BatchCostModel:
    rows: list[int]  # measured row counts, increasing, from 1
    curves: list[CostModel]  # for each: a pass's seconds by nodes per row and cache length
    overhead: float = 0.0  # seconds of work around the pass, per request per step
    drafting: float = 0.0  # of which drafting, choosing and the drafter's update, when it drafts
    seen: int = 0  # steps the overhead has been learnt from
    # The linear kernel each pass size (rows x nodes tokens) was timed with: that of
    # the single-request table's nearest size (``CostModel.kernel``), as verification uses.
    kernel_table: CostModel | None = None
    path: str | None = field(default=None, compare=False)
    weight: float = 0.05  # how fast the running mean of the overhead moves
    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.curves):
            raise ValueError("batch cost model: expected one curve per row count")
        if list(self.rows) != sorted(set(self.rows)) or self.rows[0] != 1:
            raise ValueError(f"batch cost model: row counts must start at 1 and increase, got {self.rows}")
        if not self.overhead >= 0:
            raise ValueError(f"batch cost model: overhead: expected a non-negative time, got {self.overhead}")

    def pass_seconds(self, rows: int, nodes: float, cached: int) -> float:
        """One pass of ``rows`` trees of ``nodes`` nodes each."""
        return self._pass(rows, [curve.predict for curve in self.curves], nodes, cached)

    def _pass(self, rows: int, predicts: Sequence[Callable[[int, int], float]], nodes: int, cached: int) -> float:
        i, j, w = bracket(self.rows, rows)
        low = predicts[i](nodes, cached)
        if w == 0:
            return low
        high = predicts[j](nodes, cached)
        # Past the largest measured count this extrapolates along the last segment,
        # never below the lower of the two counts' own times.
        return max((1 - w) * low + w * high, min(low, high))

    def around(self, rows: int, drafting: bool) -> float:
        """Seconds of work around the pass: with ``drafting``, what drafting adds too."""
        return rows * (self.overhead if drafting else max(self.overhead - self.drafting, 0.0))

    def predict(self, rows: int, nodes: float, cached: int, drafting: bool = True) -> float:
        """Seconds for one step of the batch: the pass and the work around it."""
        return self.pass_seconds(rows, nodes, cached) + self.around(rows, drafting)

    def draw(self, rng: random.Random) -> Callable[..., float]:
        """A plausible step-cost function (every curve drawn from its uncertainty,
        ``CostModel.draw``), for Thompson sampling as in the single-request budget."""
        predicts = [curve.draw(rng) for curve in self.curves]
        return lambda rows, nodes, cached, drafting=True: (self._pass(rows, predicts, nodes, cached)
                                                           + self.around(rows, drafting))

    def refresh(self, rows: int, nodes: float, cached: int, pass_seconds: float, step_seconds: float,
                drafting_seconds: float | None = None) -> None:
        """A step of ``rows`` trees of ``nodes`` nodes took ``step_seconds``, its pass
        ``pass_seconds`` of them and drafting ``drafting_seconds`` (None: the step did
        not draft)."""
        i, j, w = bracket(self.rows, rows)
        nearest = j if w > 0.5 else i
        if self.rows[nearest] == rows or len(self.rows) == 1:
            factor = self.curves[nearest].refresh(nodes, cached, pass_seconds)
        else:
            # A row count between measured ones teaches no curve its shape, only the scale.
            predicted = self.pass_seconds(rows, nodes, cached)
            error = max(-0.5 * predicted, min(0.5 * predicted, pass_seconds - predicted))
            factor = 1.0 + self.curves[nearest].drift * error / predicted
            self.curves[nearest].scale(factor)
        for k, curve in enumerate(self.curves):
            if k != nearest:
                curve.scale(factor)
        around = max(step_seconds - pass_seconds, 0.0) / max(rows, 1)
        # The first steps average evenly; after that the mean follows the current load.
        self.seen += 1
        weight = max(1.0 / self.seen, self.weight)
        if drafting_seconds is None:  # a step without drafts: the rest of the work alone
            self.overhead += weight * (around + self.drafting - self.overhead)
        else:
            self.overhead += weight * (around - self.overhead)
            self.drafting += weight * (min(drafting_seconds / max(rows, 1), around) - self.drafting)

    def to_json(self) -> dict:
        return {"format": FORMAT, "rows": list(self.rows), "curves": [curve.to_json() for curve in self.curves],
                "overhead": self.overhead, "drafting": self.drafting, "seen": self.seen,
                "kernel_table": self.kernel_table.to_json() if self.kernel_table is not None else None}

    @staticmethod
    def from_json(data: dict, path: str | None = None) -> "BatchCostModel":
        if data.get("format") != FORMAT:
            raise ValueError("batch cost model: unknown format")
        curves = [CostModel.from_json(curve) for curve in data["curves"]]
        overhead = float(data.get("overhead", 0.0))
        if not math.isfinite(overhead):
            raise ValueError("batch cost model: overhead is not finite")
        kernels = data.get("kernel_table")
        return BatchCostModel([int(r) for r in data["rows"]], curves, overhead, float(data.get("drafting", 0.0)),
                              int(data.get("seen", 0)),
                              CostModel.from_json(kernels) if kernels else None, path)

    def save(self) -> None:
        if self.path:
            _write_json(Path(self.path), self.to_json())


def as_batch_cost(cost: object) -> "BatchCostModel | PerNodeCurve":
    """``cost`` as a batch's step-cost curve: a ``BatchCostModel`` (or ``PerNodeCurve``)
    as it is, a single-request curve (``predict(nodes, cached)``) read per node."""
    return cost if isinstance(cost, (BatchCostModel, PerNodeCurve)) else PerNodeCurve(cost)


class PerNodeCurve:
    """A single-request step-cost curve read as a batch's: a pass of ``rows`` trees of
    ``nodes`` nodes costs what one tree of ``rows x nodes`` nodes does. A rough prior
    (it ignores per-row attention and masks), for a batch given such a curve."""

    def __init__(self, curve: object) -> None:
        self.curve = curve

    def predict(self, rows: int, nodes: float, cached: int, drafting: bool = True) -> float:
        return self.curve.predict(rows * nodes, cached)

    def draw(self, rng: random.Random) -> Callable[..., float]:
        draw = getattr(self.curve, "draw", None)
        predict = draw(rng) if draw is not None else self.curve.predict
        return lambda rows, nodes, cached, drafting=True: predict(rows * nodes, cached)

    def refresh(self, rows: int, nodes: float, cached: int, pass_seconds: float, step_seconds: float,
                drafting_seconds: float | None = None) -> None:
        self.curve.refresh(rows * nodes, cached, step_seconds)
