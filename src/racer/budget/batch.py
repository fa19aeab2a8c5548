"""The draft budget of a batch: how many nodes each request's tree keeps when every
active request is verified in one pass. Pure Python (no torch).

A packed pass (``packed``: the rows' trees one after another in one sequence) costs
what its nodes cost, whichever rows hold them: the budget then ranks every candidate
node of the batch by its expected gain (the probability that it is accepted) and keeps
the number of them that maximises the batch's expected emitted tokens per second,
``sum_b E_b / cost(B, T / B, cache)`` for T nodes in all (``best_total``), so a row with
a long likely chain verifies it while a row of unlikely guesses verifies its root alone.

A padded pass pads every tree to the largest, so it costs what ``rows`` trees of
``nodes`` nodes cost, whichever request holds the nodes; giving one request more nodes
than the others costs as much as giving them all as many. The budget therefore chooses
one node cap N for the step: each request keeps its N most probable candidates (its
best subtree of that size, ``racer.budget.selection``), and N maximises the whole
batch's expected emitted tokens per second, ``sum_b E_b(N) / cost(B, N, cache)``, with
the cost measured on batched passes (``racer.budget.batch_cost``). As the batch grows
a node costs B rows, so N shrinks, down to 1 (no drafts) when drafting no longer pays.
"""

from __future__ import annotations

import random
from typing import Sequence

from racer.budget.acceptance import AcceptanceModel
from racer.budget.batch_cost import as_batch_cost
from racer.budget.selection import StepTiming, WholeTree, ranked
from racer.drafting.tree import DraftTree


def expected_by_size(tree: DraftTree, probs: Sequence[float]) -> tuple[list[int], list[float]]:
    """The tree's candidates, most probable first, and the expected emitted tokens of its
    best subtree of each size 1..len(tree) (``racer.budget.selection.ranked``)."""
    return ranked(tree.parents, probs)


def best_cap(expected: Sequence[Sequence[float]], cost: "callable", largest: int) -> tuple[int, float]:
    """The node cap N (1..``largest``) that maximises the batch's expected tokens per
    second, ``sum_b expected[b][min(N, len_b) - 1] / cost(N)``, and that rate. Ties go to
    the smaller cap."""
    best, best_rate = 1, -1.0
    for cap in range(1, largest + 1):
        tokens = sum(e[min(cap, len(e)) - 1] for e in expected)
        rate = tokens / _positive(cost(cap), cap, "a cap of ")
        if rate > best_rate:
            best, best_rate = cap, rate
    return best, best_rate


def best_total(expected: Sequence[Sequence[float]], cost: "callable") -> tuple[list[int], float]:
    """How many nodes each row keeps (root included) so that the batch's expected
    tokens per second, ``sum_b expected[b][kept_b - 1] / cost(T)`` for T nodes in all,
    is largest, and that rate. A row's nodes are added in its own order (each row's
    gains, ``expected[b][k] - expected[b][k - 1]``, do not grow with k); across rows,
    the larger gain first. Ties go to fewer nodes."""
    gains = sorted(((e[k] - e[k - 1], -b, -k) for b, e in enumerate(expected) for k in range(1, len(e))),
                   reverse=True)
    kept = [1] * len(expected)
    tokens = sum(e[0] for e in expected)
    total = len(expected)
    best, best_rate = 0, tokens / _positive(cost(total), total)
    for added, (gain, _, _) in enumerate(gains, start=1):
        tokens += gain
        rate = tokens / _positive(cost(total + added), total + added)
        if rate > best_rate:
            best, best_rate = added, rate
    for _, row, _ in gains[:best]:
        kept[-row] += 1
    return kept, best_rate


def _positive(seconds: float, nodes: int, what: str = "") -> float:
    if not float(seconds) > 0:
        raise ValueError(f"cost: expected a positive time for {what}{nodes} nodes, got {seconds}")
    return float(seconds)


class BatchBudget(WholeTree):
    """Per step, the node cap and each request's kept subtree, from the batch's
    step-cost curve (``predict(rows, nodes, cached, drafting)``; a single-request curve
    is read per node, ``batch_cost.PerNodeCurve``) and each request's own acceptance
    model.

    Drafting itself costs time (proposing, choosing, the drafters' updates), which a
    cap of 1 does not win back. A cap above 1 is kept only when its rate, drafting
    included, is ``margin`` (10 %) better than the batch's without drafting. Each
    drafting step's advantage over not drafting (its rate over the plain rate, minus 1:
    negative by the drafting cost in a step that keeps cap 1) enters a running mean;
    while that mean is positive every step drafts, so a request whose drafts pay in
    bursts (a retrieval match now and then) gets each burst. When the mean falls to 0
    or below, drafting has cost more than it gave lately: the budget stops drafting
    for a while (``drafts()`` is False: the decoder verifies bare roots and calls
    no drafter), then drafts one step again to see whether drafts pay now, waiting
    twice as long after each miss, up to ``longest_pause`` steps. With one request a
    drafting step costs little beside its pass, so it seldom pauses; with many, a cap
    of 1 wastes every row's drafting, and the mean turns negative within a few steps.

    The cap is chosen on each acceptance model's mean rates (``explore`` draws them
    from their posteriors instead, as the one-row budget does): the best of
    many caps on a sum of B noisy draws is the one whose draws came out high, so a
    batch would verify more than pays on average. The cost curve is still drawn, and
    the probes after a pause keep every request's evidence coming. The margin is there
    for the same reason: the steps chosen for drafting are those whose estimates came
    out high, so they promise more than they give (docs/serving.md has the figures)."""

    def __init__(self, cost: object, seed: int = 0, longest_pause: int = 32, explore: bool = False,
                 margin: float = 0.1, weight: float = 0.1) -> None:
        self.cost = as_batch_cost(cost)
        self.explore = explore
        self.margin = margin
        self.weight = weight  # how fast the running advantage follows the latest steps
        self.advantage = 0.0  # running mean of drafting steps' rate over the plain rate, minus 1
        self.rng = random.Random(seed)
        self.last_cap = 1
        self.longest_pause = longest_pause
        self._pause = 0  # steps left without drafts
        self._misses = 0  # probes in a row that found drafts not paying

    def drafts(self) -> bool:
        """Whether the step about to run drafts; a step that does not counts off the pause."""
        if self._pause > 0:
            self._pause -= 1
            return False
        return True

    def ask(self, size: int) -> int:
        """How many candidates to ask each drafter for: room to grow past the last cap
        without proposing (and ranking) many more nodes than a busy batch keeps."""
        return min(size, 2 * self.last_cap + 8)

    def select(self, trees: Sequence[DraftTree], acceptances: Sequence[AcceptanceModel],
               cached: Sequence[int]) -> list[DraftTree]:
        if not trees:
            return []
        ranked = [expected_by_size(tree, model.probabilities(tree, explore=self.explore))
                  for tree, model in zip(trees, acceptances)]
        draw = getattr(self.cost, "draw", None)
        predict = draw(self.rng) if draw is not None else self.cost.predict
        rows = len(trees)
        longest = max(cached)
        if self.packed:
            kept, rate = best_total([expected for _, expected in ranked],
                                    lambda total: predict(rows, total / rows, longest))
        else:
            largest = max(len(tree) for tree in trees)
            cap, rate = best_cap([expected for _, expected in ranked], lambda n: predict(rows, n, longest), largest)
            kept = [cap] * rows
        plain = rows / predict(rows, 1, longest, drafting=False)
        if rate <= plain * (1.0 + self.margin):
            kept, rate = [1] * rows, rows / predict(rows, 1, longest)
        self.advantage += self.weight * (rate / plain - 1.0 - self.advantage)
        if self.advantage <= 0:
            self._misses += 1
            self._pause = min(2 ** (self._misses - 1), self.longest_pause)
            self.advantage = 0.0  # the probe after the pause judges afresh
        else:
            self._misses = 0
        self.last_cap = max(kept)
        return [tree.subtree(sorted([0] + order[: n - 1])) for tree, (order, _), n in zip(trees, ranked, kept)]

    def observe(self, step: StepTiming) -> None:
        """Refresh the batch's cost curve with the step: ``rows`` trees padded to the
        largest (or packed: as many nodes per row as they hold on average), on the
        longest row's cache."""
        rows = len(step.trees)
        nodes = (sum(len(tree) for tree in step.trees) / rows if self.packed
                 else max(len(tree) for tree in step.trees))
        self.cost.refresh(rows, nodes, max(step.lengths), step.pass_s, step.step_s, step.drafting_s)
