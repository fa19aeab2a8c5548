"""Tree selection against exhaustive search, and how the cost curve shapes it."""

import random

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
