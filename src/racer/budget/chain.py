"""The draft budget of an engine that verifies chains (vLLM): how likely a draft token
must be to earn its place in the pass. Pure Python and NumPy (no torch).

Such an engine verifies every token it is given, so each one costs a position of the
pass whether or not it is reached. From the engine's own steps, timed as they come, a
linear fit ``seconds = a + c * rows + b * draft tokens`` gives b, the cost of one more
verified draft token beside the per-request cost c. One more token reached with
probability p adds p expected tokens for b seconds; at the current rate of R emitted
tokens per second it pays when p > b * R, which is the floor returned."""

from __future__ import annotations

from collections import deque

import numpy as np


class ChainBudget:
    """The least path probability worth verifying, from the last ``window`` steps.

    Until ``warmup`` steps are in, or while the steps' draft sizes do not vary enough
    to tell their cost from the rows', the floor is ``before``."""

    def __init__(self, window: int = 256, warmup: int = 32, before: float = 0.0) -> None:
        if window < 3 or warmup < 3:
            raise ValueError(f"expected a window and warm-up of at least 3 steps, got {window}, {warmup}")
        if not 0.0 <= before <= 1.0:
            raise ValueError(f"before: expected a probability in [0, 1], got {before}")
        self.warmup, self.before = warmup, before
        self.steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)  # rows, drafted, emitted, s

    def observe(self, rows: int, drafted: int, emitted: int, seconds: float) -> None:
        """One step: ``rows`` requests with ``drafted`` draft tokens in all verified in
        ``seconds``, emitting ``emitted`` tokens."""
        if rows > 0 and seconds > 0:
            self.steps.append((rows, drafted, emitted, seconds))

    def fit(self) -> tuple[float, float] | None:
        """b of the fit and the steps' emitted tokens per second, or None where the
        steps cannot tell b."""
        if len(self.steps) < self.warmup:
            return None
        data = np.array(self.steps, dtype=float)
        drafted = data[:, 1]
        if drafted.std() < 1.0:  # nearly the same draft size every step: b is not identifiable
            return None
        design = np.column_stack([np.ones(len(data)), data[:, 0], drafted])
        (_, _, per_token), *_ = np.linalg.lstsq(design, data[:, 3], rcond=None)
        return max(0.0, float(per_token)), data[:, 2].sum() / data[:, 3].sum()

    def cost_per_token(self) -> float | None:
        """b of the fit, or None where the steps cannot tell it."""
        fit = self.fit()
        return None if fit is None else fit[0]

    def floor(self) -> float:
        """The least probability of being reached that a chain's token should have."""
        fit = self.fit()
        return self.before if fit is None else min(1.0, fit[0] * fit[1])
