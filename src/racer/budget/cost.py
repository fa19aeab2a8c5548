"""What a decoding step costs on this hardware, as a function of the verified tree's
size and the cache length: a table measured once per model/device/dtype/threads
(``racer.engine.calibration``) and refreshed from the step timings of real decoding.
Pure Python (no torch).

Model: ``seconds(n, L) = base(n) + (L - L0) * (per_position + per_position_node * n)``,
``base`` piecewise linear over measured sizes at cache length ``L0``. A CPU's curve is
far from smooth (a 2- or 3-row matmul can cost more than a 4-row one), which is why
it is a table and not a fitted formula.

Each size keeps the linear kernel that verified it fastest (``racer.fastpaths.KERNELS``),
and the verifier uses that kernel for that size. A prompt's chunks are far wider than
any tree, so the table also keeps the kernel that computed a pass of ``PREFILL`` prompt
tokens fastest (``prefill_kernel``), for passes nearer that width than the largest tree.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from racer.fastpaths import KERNELS

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL = 256  # prompt tokens in the pass that chooses the kernel of prompt chunks
# Raised whenever what a table's numbers mean changes (how it is timed or refreshed);
# tables of another format are measured again.
FORMAT = 8


PRIOR_SPREAD = 0.15  # how far off (relative, one sigma) a freshly calibrated size may be
MAX_VARIANCE = (2 * PRIOR_SPREAD) ** 2


def bracket(points: Sequence[int], x: int) -> tuple[int, int, float]:
    """Indices i, j of the increasing ``points`` around ``x`` and the weight of j for
    linear interpolation (past the last point, the last segment extended: w > 1)."""
    if x <= points[0] or len(points) == 1:
        return 0, 0, 0.0
    if x >= points[-1]:
        i, j = len(points) - 2, len(points) - 1
    else:
        j = next(k for k, p in enumerate(points) if p >= x)
        i = j - 1
    return i, j, (x - points[i]) / (points[j] - points[i])


@dataclass
class CostModel:
    sizes: list[int]
    seconds: list[float]  # step time at each size, cache length ``length``
    length: int
    per_position: float = 0.0  # growth per cached token, per step
    per_position_node: float = 0.0  # growth per cached token, per tree node
    kernels: list[str] = field(default_factory=list)  # fastest linear kernel at each size ("model" if empty)
    # The fastest kernel for a pass of ``prefill_size`` prompt tokens (0: not measured).
    prefill_size: int = 0
    prefill_kernel: str = "model"
    # How uncertain each size's time is (variance of its log): shrinks as steps of that
    # size are seen, grows back slowly (up to MAX_VARIANCE) while they are not.
    variance: list[float] = field(default_factory=list)
    path: str | None = field(default=None, compare=False)  # where refreshes are saved
    drift: float = 0.1  # how fast step timings scale the whole curve
    noise: float = 0.01  # variance of one step's log time around the curve (10 % jitter)
    wander: float = 1e-4  # how much a size's variance grows per step (its time may change)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("cost model: expected one time per size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] != 1:
            raise ValueError(f"cost model: sizes must start at 1 and increase, got {self.sizes}")
        if not all(s > 0 for s in self.seconds):
            raise ValueError("cost model: times must be positive")
        self.kernels = list(self.kernels) or ["model"] * len(self.sizes)
        if len(self.kernels) != len(self.sizes) or not set(self.kernels) <= set(KERNELS):
            raise ValueError(f"cost model: expected one kernel from {KERNELS} per size, got {self.kernels}")
        if self.prefill_kernel not in KERNELS or self.prefill_size < 0:
            raise ValueError(f"cost model: expected a prefill kernel from {KERNELS} and a size >= 0, "
                             f"got {self.prefill_kernel!r} at {self.prefill_size}")
        self.variance = list(self.variance) or [PRIOR_SPREAD ** 2] * len(self.sizes)
        if len(self.variance) != len(self.sizes) or not all(v > 0 for v in self.variance):
            raise ValueError("cost model: expected one positive variance per size")

    def _bracket(self, n: int) -> tuple[int, int, float]:
        return bracket(self.sizes, n)

    def predict(self, nodes: int, cached: int) -> float:
        """Seconds for one step verifying ``nodes`` nodes on a cache of ``cached`` tokens."""
        return self._predict(self.seconds, nodes, cached)

    def _predict(self, seconds: Sequence[float], nodes: int, cached: int) -> float:
        i, j, w = self._bracket(nodes)
        base = (1 - w) * seconds[i] + w * seconds[j]
        if w > 1 and seconds[j] < seconds[i]:
            # Past the largest measured size (a context too short to measure more) the
            # last segment's slope may be negative on a noisy CPU: grow at the curve's
            # mean slope instead, never shrink.
            slope = max((seconds[-1] - seconds[0]) / (self.sizes[-1] - self.sizes[0]), 0.0)
            base = seconds[-1] + slope * (nodes - self.sizes[-1])
        growth = (cached - self.length) * (self.per_position + self.per_position_node * nodes)
        return max(base + growth, 0.25 * base)

    def draw(self, rng: random.Random) -> Callable[[int, int], float]:
        """A plausible curve (each size's time drawn from its uncertainty), as a
        ``predict`` function. Choosing by a fresh draw each step (Thompson sampling)
        now and then verifies a size whose time is uncertain because it is seldom
        verified; choosing by ``predict`` alone would never learn that a size the
        calibration made look dear is cheap."""
        seconds = [s * math.exp(rng.gauss(0.0, math.sqrt(v))) for s, v in zip(self.seconds, self.variance)]
        return lambda nodes, cached: self._predict(seconds, nodes, cached)

    def kernel(self, n: int) -> str:
        """The linear kernel for a pass of ``n`` positions: that of the nearest measured
        size (the smaller on a tie), the prefill pass's among them where measured."""
        if self.prefill_size > self.sizes[-1] and n - self.sizes[-1] > self.prefill_size - n:
            return self.prefill_kernel
        i, j, w = self._bracket(n)
        return self.kernels[j] if w > 0.5 else self.kernels[i]

    @property
    def used_kernels(self) -> list[str]:
        """Every kernel ``kernel`` can return."""
        return sorted({*self.kernels, self.prefill_kernel})

    def refresh(self, nodes: int, cached: int, seconds: float) -> float:
        """Pull the table toward an observed step time, in two parts: the scale of the
        whole curve follows fast (the machine got busier or quieter: every size moves,
        so sizes seldom verified do not go stale and misrank against fresh ones), and
        the two sizes around ``nodes`` learn what the scale leaves (the shape) by a
        Kalman step: a size still uncertain moves most of the way at once, one seen
        many times moves little on one noisy step. Outliers (a page fault, the other
        core busy) are clipped to half the prediction, so one slow step cannot move
        it far. Returns the scale applied to the whole curve."""
        predicted = self.predict(nodes, cached)
        error = max(-0.5 * predicted, min(0.5 * predicted, seconds - predicted))
        factor = 1.0 + self.drift * error / predicted
        self.scale(factor)
        residual = (predicted + error) / (predicted * factor) - 1.0  # relative, after the scale
        # A size long unseen grows at most twice as uncertain as a fresh calibration (the
        # curve's shape itself changes with the machine's state): its draws explore it
        # now and then without proposing absurd times.
        self.variance = [min(v + self.wander, MAX_VARIANCE) for v in self.variance]
        i, j, w = self._bracket(nodes)
        if nodes > self.sizes[-1]:
            i, w = j, 0.0  # beyond the table: only the last measured size moves
        weights = [(i, 1.0 - w)] + ([(j, w)] if j != i and w > 0 else [])
        spread = sum(h * h * self.variance[k] for k, h in weights) + self.noise
        for k, h in weights:
            gain = h * self.variance[k] / spread
            self.seconds[k] = max(self.seconds[k] * (1.0 + gain * residual), 1e-6)
            self.variance[k] *= 1.0 - gain * h
        return factor

    def scale(self, factor: float) -> None:
        """Every time times ``factor`` (the machine got slower or faster)."""
        self.seconds = [s * factor for s in self.seconds]
        self.per_position *= factor
        self.per_position_node *= factor

    def to_json(self) -> dict:
        data = asdict(self)
        for setting in ("path", "drift", "noise", "wander"):
            data.pop(setting)
        return {"format": FORMAT, **data}

    @staticmethod
    def from_json(data: dict, path: str | None = None) -> "CostModel":
        if data.get("format") != FORMAT:
            raise ValueError("cost model: unknown format")
        return CostModel(list(data["sizes"]), list(data["seconds"]), int(data["length"]),
                         float(data["per_position"]), float(data["per_position_node"]),
                         [str(k) for k in data["kernels"]], int(data["prefill_size"]), str(data["prefill_kernel"]),
                         [float(v) for v in data.get("variance", [])], path)

    def save(self) -> None:
        """Write the (refreshed) table back to its cache file, atomically."""
        if self.path:
            _write_json(Path(self.path), self.to_json())


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(data, out)
    os.replace(tmp, path)
