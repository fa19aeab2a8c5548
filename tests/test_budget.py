"""Tree selection against exhaustive search, and how the cost curve shapes it."""

import math
import random
import statistics

import pytest

from racer.budget import best_subtree, path_probabilities


def closed_subtrees(parents):
    """Every node set that contains the root and each member's parent."""
    n = len(parents)
    for mask in range(1 << (n - 1)):
        nodes = [0] + [i for i in range(1, n) if mask >> (i - 1) & 1]
        chosen = set(nodes)
        if all(parents[i] in chosen for i in nodes[1:]):
            yield nodes


def exhaustive(parents, accept, cost):
    probs = path_probabilities(parents, accept)
    return max((1 + sum(probs[i] for i in nodes[1:])) / cost(len(nodes)) for nodes in closed_subtrees(parents))


def random_tree(rng, n):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    accept = [1.0] + [rng.choice([0.0, 0.05, 0.3, 0.5, 0.5, 0.9, 1.0, rng.random()]) for _ in range(1, n)]
    return parents, accept


COSTS = {
    "flat": lambda n: 1.0,
    "linear": lambda n: 1.0 + 0.1 * n,
    "cpu-like": lambda n: 72 + 4.5 * max(0, n - 1),  # ms; ~355 ms at 64 nodes
    "steps": lambda n: 1.0 if n <= 4 else 1.6 if n <= 8 else 3.0,
}


@pytest.mark.parametrize("name", COSTS)
def test_selection_finds_the_exhaustive_optimum(name):
    rng = random.Random(7)
    cost = COSTS[name]
    for _ in range(150):
        parents, accept = random_tree(rng, rng.randrange(1, 11))
        nodes, rate = best_subtree(parents, accept, cost)
        assert set(parents[i] for i in nodes[1:]) <= set(nodes)  # closed under parents
        probs = path_probabilities(parents, accept)
        assert rate == pytest.approx((1 + sum(probs[i] for i in nodes[1:])) / cost(len(nodes)))
        assert rate == pytest.approx(exhaustive(parents, accept, cost))


def test_flat_cost_keeps_every_node_that_can_be_accepted():
    parents = [-1, 0, 0, 1, 1, 3, 2]
    accept = [1, 0.6, 0.3, 0.5, 0.2, 0.1, 0.05]
    nodes, _ = best_subtree(parents, accept, lambda n: 1.0)
    assert nodes == list(range(7))


def test_flat_cost_keeps_even_nodes_whose_probability_vanishes():
    # Path probabilities of 0 and of 1e-300 (lost when added to 1.6): free all the same.
    parents = [-1, 0, 1, 2, 0]
    accept = [1, 0.6, 1e-150, 1e-150, 0.0]
    assert best_subtree(parents, accept, lambda n: 1.0)[0] == list(range(5))
    # At any positive price per node they go.
    assert best_subtree(parents, accept, lambda n: 1 + 0.01 * n)[0] == [0, 1]


def test_steep_cost_shrinks_the_tree():
    parents = [-1, 0, 0, 1, 1, 3, 2]
    accept = [1, 0.6, 0.3, 0.5, 0.2, 0.1, 0.05]
    # One node costs 1, each more costs 0.5: only nodes worth half a token stay.
    nodes, rate = best_subtree(parents, accept, lambda n: 1 + 0.5 * (n - 1))
    assert nodes == [0, 1]  # path probabilities: 0.6, 0.3, 0.3, 0.12, ...
    assert rate == pytest.approx(1.6 / 1.5)
    # Prohibitive: the root alone.
    assert best_subtree(parents, accept, lambda n: n ** 3)[0] == [0]


def test_bad_input():
    with pytest.raises(ValueError, match="parents"):
        best_subtree([0, 0], [1, 1], lambda n: 1)
    with pytest.raises(ValueError, match="accept"):
        best_subtree([-1, 0], [1, 1.5], lambda n: 1)
    with pytest.raises(ValueError, match="cost"):
        best_subtree([-1, 0], [1, 0.5], lambda n: 0)


# -- the acceptance model and the budget that uses it -------------------------------------
from racer.budget import AcceptanceModel, DraftBudget, StepTiming, evidence_levels  # noqa: E402
from racer.budget.cost import MAX_VARIANCE, CostModel  # noqa: E402
from racer.drafting.tree import DraftTree, TreeBuilder  # noqa: E402


def two_feature_tree(root=0):
    """Root with two children, tagged "good" and "bad"; each with one child below."""
    b = TreeBuilder(root, 10)
    good = b.add_child(0, 1, feature=("x", "good"))
    bad = b.add_child(0, 2, feature=("x", "bad"))
    b.add_child(good, 3, feature=("x", "good"))
    b.add_child(bad, 4, feature=("x", "bad"))
    return b.build()


def test_acceptance_model_learns_rates_by_feature():
    rng = random.Random(0)
    model = AcceptanceModel()
    tree = two_feature_tree()
    good, bad = tree.child(0, 1), tree.child(0, 2)
    for _ in range(2000):
        first = good if rng.random() < 0.6 else bad if rng.random() < 0.25 else None
        path = [0] if first is None else [0, first]
        # Below an accepted node, its child is accepted with the same feature's rate.
        if first == good and rng.random() < 0.6:
            path.append(tree.child(good, 3))
        model.observe(tree, path)
    assert model.estimate(("x", "good")) == pytest.approx(0.6, abs=0.06)
    assert model.estimate(("x", "bad")) == pytest.approx(0.4 * 0.25, abs=0.06)


def test_only_nodes_whose_parent_was_accepted_count():
    model = AcceptanceModel()
    tree = two_feature_tree()
    for _ in range(50):
        model.observe(tree, [0])  # both depth-1 nodes tried and rejected; depth 2 not tried
    tried_good = model.counts[("x", "good")][1]
    assert tried_good == 50  # the depth-2 "good" node never counted: its parent was never accepted
    assert model.estimate(("x", "good")) < 0.1


def test_unseen_feature_leans_on_its_group():
    model = AcceptanceModel()
    b = TreeBuilder(0, 10)
    for token in range(1, 6):
        b.add_child(0, token, feature=("y", token))
    tree = b.build()
    for _ in range(200):
        model.observe(tree, [0, 1])  # child 1 always right, the others never
    assert model.estimate(("y", 99)) == pytest.approx(1 / 5, abs=0.03)  # the group's rate
    probs = model.probabilities(tree)
    assert probs[0] == 1.0 and probs[1] > 0.9 and max(probs[2:]) < 0.1
    assert sum(probs[1:]) == pytest.approx(1.0, abs=0.1)  # learnt rates add up by themselves
    # Nodes without a feature are keyed by depth.
    plain = DraftTree((0, 7, 8), (-1, 0, 1), (0, 1, 2), ({7: 1}, {8: 2}, {}))
    for _ in range(100):
        model.observe(plain, [0, 1])
    assert model.estimate(("depth", 1)) > 0.9 and model.estimate(("depth", 2)) < 0.1


def test_unseen_key_leans_on_its_closest_level():
    # Rank-0 copy-logit nodes have only ever been tried at depth 1, and always accepted;
    # ranks 1-4 never. A rank-0 node at depth 3 starts from rank 0's record, not from
    # the source's average (1 in 5).
    model = AcceptanceModel()
    b = TreeBuilder(0, 10)
    for rank in range(5):
        b.add_child(0, 10 + rank, feature=("logits", rank, 1))
    tree = b.build()
    for _ in range(200):
        model.observe(tree, [0, tree.child(0, 10)])
    assert model.estimate(("logits", 0, 3)) > 0.9
    assert model.estimate(("logits", 3, 3)) < 0.05
    assert model.estimate(("logits", 7, 3)) == pytest.approx(0.2, abs=0.03)  # an unseen rank: the source's rate
    assert model.estimate(("unseen", 1)) == pytest.approx(0.5)  # nothing known: the uniform prior
    assert evidence_levels(("logits", 0, 3)) == [("logits",), ("logits", 0), ("logits", 0, 3)]
    assert evidence_levels("flat") == ["flat"]


class Fixed:
    def __init__(self, curve):
        self.curve, self.seen = curve, []

    def predict(self, nodes, cached):
        return self.curve(nodes)

    def refresh(self, nodes, cached, seconds):
        self.seen.append((nodes, cached, seconds))


def wide_tree(size=30):
    b = TreeBuilder(0, size)
    node = 0
    for token in range(1, size):
        b.add_child(node if token % 3 else 0, token, feature=("z", token % 4))
        node = len(b) - 1
    return b.build()


def test_budget_keeps_the_full_tree_on_a_flat_curve_and_shrinks_on_a_steep_one():
    tree = wide_tree()
    flat = DraftBudget(Fixed(lambda n: 1.0))
    steep = DraftBudget(Fixed(lambda n: float(n)))
    assert len(flat.select([tree], [AcceptanceModel()], [100])[0]) == len(tree)
    [chosen] = steep.select([tree], [AcceptanceModel()], [100])
    assert 1 <= len(chosen) < len(tree)
    # The kept part is a subtree of the candidate: every kept node's path is in it.
    for node in range(1, len(chosen)):
        assert chosen.tokens[chosen.parents[node]] == tree.tokens[tree.parents[tree.tokens.index(chosen.tokens[node])]]


def test_budget_refreshes_the_cost_curve_with_step_times():
    cost = Fixed(lambda n: 1.0)
    budget = DraftBudget(cost)
    tree = wide_tree(5)
    budget.observe(StepTiming([tree], [42], pass_s=0.2, step_s=0.25, drafting_s=0.05))
    assert cost.seen == [(5, 42, 0.25)]  # the whole step's time, by the verified tree's size
    with pytest.raises(ValueError, match="one row"):
        budget.select([tree, tree], [AcceptanceModel()] * 2, [0, 0])


# -- the cost model -----------------------------------------------------------------------
def test_cost_model_interpolates_and_grows_with_the_cache():
    model = CostModel([1, 4, 8], [0.05, 0.08, 0.10], length=100, per_position=1e-5, per_position_node=1e-6)
    assert model.predict(1, 100) == pytest.approx(0.05)
    assert model.predict(6, 100) == pytest.approx(0.09)
    assert model.predict(16, 100) == pytest.approx(0.14)  # beyond the table: the last slope
    assert model.predict(4, 1100) == pytest.approx(0.08 + 1000 * (1e-5 + 4e-6))
    bumpy = CostModel([1, 2, 3, 4], [0.05, 0.09, 0.12, 0.08], length=0)  # not smooth: kept as measured
    assert [bumpy.predict(n, 0) for n in (1, 2, 3, 4)] == [0.05, 0.09, 0.12, 0.08]


def test_cost_model_refresh_converges_to_observed_times_and_clips_outliers():
    model = CostModel([1, 8, 64], [0.05, 0.10, 0.30], length=0)
    for _ in range(400):
        model.refresh(8, 0, 0.14)
    assert model.predict(8, 0) == pytest.approx(0.14, rel=1e-3)
    # The sizes never observed moved with the scale, keeping their ratio.
    assert model.predict(1, 0) > 0.05 and model.predict(64, 0) > 0.30
    assert model.predict(64, 0) / model.predict(1, 0) == pytest.approx(6.0)
    before = model.predict(8, 0)
    model.refresh(8, 0, 100.0)  # a stall, once 8 is well known: clipped, and a small step
    assert before < model.predict(8, 0) <= before * 1.15
    model.refresh(4, 0, 0.12)  # between two sizes: both move
    assert model.seconds[0] != 0.05 and model.seconds[1] != pytest.approx(0.14, rel=1e-6)


def test_an_uncertain_size_learns_at_once_a_known_one_slowly():
    fresh = CostModel([1, 8, 64], [0.05, 0.10, 0.30], length=0)
    fresh.refresh(8, 0, 0.13)  # 30 % dearer than calibrated: a third of the way in one step
    assert fresh.predict(8, 0) > 0.11
    known = CostModel([1, 8, 64], [0.05, 0.10, 0.30], length=0)
    for _ in range(200):
        known.refresh(8, 0, 0.10)
    known.refresh(8, 0, 0.13)  # the same step after 200 agreeing ones: one noisy step among many
    assert known.predict(8, 0) - 0.10 < (fresh.predict(8, 0) - 0.10) / 2
    assert known.variance[1] < fresh.variance[1] < known.variance[0]  # unseen sizes stayed uncertain


def test_a_busier_machine_moves_every_size_and_unseen_sizes_are_drawn_wider():
    # Only 4-node steps are seen, at twice the predicted time: every size moves with the
    # scale, the sizes never seen grow uncertain (so the budget's draws try them), and a
    # few steps of such a size bring it in line.
    model = CostModel([1, 4, 16, 64], [0.10, 0.10, 0.15, 0.30], length=0)
    for _ in range(300):
        model.refresh(4, 0, 0.20)
    assert model.predict(4, 0) == pytest.approx(0.20, rel=1e-2)
    assert model.predict(64, 0) > 0.30 * 1.1
    rng = random.Random(0)
    draws = [[draw(n, 0) for n in (4, 64)] for draw in (model.draw(rng) for _ in range(400))]
    spread = {n: statistics.pstdev(math.log(d[i]) for d in draws) for i, n in enumerate((4, 64))}
    assert spread[4] < 0.05 < 0.15 < spread[64]
    for _ in range(5000):  # however long a size goes unseen, its draws stay plausible
        model.refresh(4, 0, 0.20)
    assert max(model.variance) == pytest.approx(MAX_VARIANCE)
    for _ in range(5):
        model.refresh(64, 0, 0.60)
    assert model.predict(64, 0) / model.predict(4, 0) == pytest.approx(3.0, rel=0.15)


def test_budget_chooses_by_a_fresh_draw_of_an_uncertain_curve():
    # Two sizes the calibration thinks equally dear, every candidate worth about its
    # cost: with an uncertain curve the chosen size varies, with a certain one it does not.
    tree = wide_tree(9)
    sizes = {}
    for spread in (1e-9, 0.3 ** 2):
        curve = CostModel([1, 9], [0.1, 0.1 * 1.8], length=0, variance=[spread, spread])
        budget, pinned = DraftBudget(curve), AcceptanceModel(strength=1e6)  # rates pinned near the prior 0.5
        sizes[spread] = {len(budget.select([tree], [pinned], [0])[0]) for _ in range(50)}
    assert len(sizes[1e-9]) == 1 and len(sizes[0.3 ** 2]) > 1


def test_cost_model_round_trips_and_refuses_bad_tables(tmp_path):
    model = CostModel([1, 2], [0.01, 0.02], length=5, per_position=1e-6, kernels=["packed", "weight_major"],
                      path=str(tmp_path / "c.json"))
    model.save()
    import json

    again = CostModel.from_json(json.loads((tmp_path / "c.json").read_text()))
    assert (again.sizes, again.seconds, again.length, again.per_position) == ([1, 2], [0.01, 0.02], 5, 1e-6)
    assert again.kernels == ["packed", "weight_major"]
    assert CostModel([1, 2], [1.0, 1.0], length=0).kernels == ["model", "model"]  # the model's own layers
    for sizes, seconds in (([2, 4], [1.0, 1.0]), ([1, 1], [1.0, 1.0]), ([1], [0.0]), ([1, 2], [1.0])):
        with pytest.raises(ValueError, match="cost model"):
            CostModel(sizes, seconds, length=0)
    for kernels in (["model"], ["model", "model", "fast"]):  # one known kernel per size
        with pytest.raises(ValueError, match="kernel"):
            CostModel([1, 2, 4], [1.0, 1.0, 1.0], length=0, kernels=kernels)
    # before the kernel choice, the packed kernel, tree attention, the curve's scale,
    # per-layer kernels, the prompt chunks' kernel, the packed kernel's fused siblings
    for old in (1, 2, 3, 4, 5, 6, 7):
        with pytest.raises(ValueError, match="unknown format"):
            CostModel.from_json({**model.to_json(), "format": old})


def test_prompt_chunks_take_the_kernel_measured_on_a_prompt():
    table = CostModel([1, 2, 4], [1.0] * 3, length=0, kernels=["packed"] * 3, prefill_size=256,
                      prefill_kernel="weight_major")
    got = {n: table.kernel(n) for n in (4, 64, 130, 131, 256, 512, 4096)}
    # Nearer the largest tree than the prompt's width (or as near): the tree's; nearer the prompt's: the prompt's.
    assert got == {4: "packed", 64: "packed", 130: "packed", 131: "weight_major", 256: "weight_major",
                   512: "weight_major", 4096: "weight_major"}
    assert table.used_kernels == ["packed", "weight_major"]
    again = CostModel.from_json(table.to_json())
    assert (again.prefill_size, again.prefill_kernel) == (256, "weight_major")
    unmeasured = CostModel([1, 2, 4], [1.0] * 3, length=0, kernels=["packed"] * 3)
    assert unmeasured.kernel(4096) == "packed" and unmeasured.used_kernels == ["model", "packed"]
    for size, kernel in ((256, "fast"), (-1, "model")):
        with pytest.raises(ValueError, match="prefill kernel"):
            CostModel([1], [1.0], length=0, prefill_size=size, prefill_kernel=kernel)


def test_unmeasured_sizes_take_the_kernel_of_the_nearest_measured_size():
    model = CostModel([1, 2, 4, 8, 16], [1.0] * 5, length=0,
                      kernels=["model", "weight_major", "weight_major", "packed", "model"])
    got = {n: model.kernel(n) for n in range(1, 40)}
    assert got[1] == "model" and got[2] == got[3] == got[4] == got[5] == got[6] == "weight_major"  # 6: a tie
    assert got[7] == got[8] == got[12] == "packed" and got[13] == got[16] == got[39] == "model"


def test_cost_model_never_predicts_a_free_or_negative_step_past_its_table():
    # Measured on a short context, the last two sizes came out the wrong way round.
    model = CostModel([1, 24, 32], [4.8e-4, 1.37e-3, 1.01e-3], length=24, per_position=6e-6)
    assert all(model.predict(n, 8) > 0 for n in range(1, 200))
    assert model.predict(64, 24) >= model.predict(32, 24)
