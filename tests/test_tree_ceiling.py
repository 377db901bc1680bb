"""scripts/eagle_tree_ceiling.py: the best static tree and the pass-by-pass walk, on crafted rank vectors."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eagle_tree_ceiling.py"
spec = importlib.util.spec_from_file_location("eagle_tree_ceiling", SCRIPT)
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)

CURVE = [1.0, 1.0, 1.1, 1.2]  # verify cost of 1..4 tokens, relative to one


def total_kept(anchors, tree) -> int:
    return sum(ceiling.kept(ranks, tree) for ranks, _, _ in anchors)


def brute_force_best(anchors, budget: int, branch: int, depth: int) -> int:
    """The most tokens any prefix-closed tree of `budget` nodes keeps, over every such tree."""
    nodes = [n for d in range(1, depth + 1) for n in itertools.product(range(branch), repeat=d)]
    best = 0
    for subset in itertools.combinations(nodes, budget):
        tree = set(subset)
        if all(len(n) == 1 or n[:-1] in tree for n in tree):
            best = max(best, total_kept(anchors, tree))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [1, 3, 4])
def test_best_tree_is_the_optimum(seed, budget):
    rng = random.Random(seed)
    anchors = [([min(int(rng.expovariate(1.2)), 3) for _ in range(3)], 0, 0) for _ in range(60)]
    tree = ceiling.best_tree(anchors, budget, branch=2, depth=3)
    assert len(tree) == budget
    assert all(len(n) == 1 or n[:-1] in tree for n in tree)  # prefix-closed
    assert total_kept(anchors, tree) == brute_force_best(anchors, budget, branch=2, depth=3)


def test_a_poor_tree_is_not_the_optimum():
    """Negative control: the comparison above can fail (a chain of rank 1 keeps less than the best tree)."""
    rng = random.Random(0)
    anchors = [([min(int(rng.expovariate(1.2)), 3) for _ in range(3)], 0, 0) for _ in range(60)]
    assert total_kept(anchors, {(1,), (1, 1), (1, 1, 1)}) < brute_force_best(anchors, 3, branch=2, depth=3)


def test_walk_emits_kept_tokens_plus_one_per_pass():
    # one answer of 6 anchors: the first pass keeps 2 (ranks 0, 0), then anchors 3 and 4 keep none, then the end
    turn = [([0, 0, 5], 0, 0), ([9], 0, 0), ([9], 0, 0), ([1, 0], 0, 0), ([7], 0, 0), ([0], 0, 0)]
    chain = {(0,), (0, 0)}
    tau, speed = ceiling.walk([turn], chain, CURVE, head_step=0.0)
    # passes start at anchors 0 (emits 3), 3 (emits 1), 4 (emits 1), 5 (emits 1: the answer ends)
    assert tau == pytest.approx(6 / 4)
    assert speed == pytest.approx(6 / (4 * CURVE[2]))  # a chain of 2 verifies 3 tokens a pass


def test_walk_with_lookup_verifies_the_copy_in_place_of_a_chain():
    # a copy of 3 tokens, 2 of them right, at anchor 0: the pass keeps 2 and costs 4 tokens' verification
    turn = [([5], 3, 2), ([9], 0, 0), ([9], 0, 0), ([0], 0, 0)]
    tau, speed = ceiling.walk([turn], {(0,)}, CURVE, head_step=0.0, lookup="replace")
    assert tau == pytest.approx(4 / 2)  # passes at anchors 0 (emits 3) and 3 (emits 1: the end)
    assert speed == pytest.approx(4 / (CURVE[3] + CURVE[1]))
    tau_without, _ = ceiling.walk([turn], {(0,)}, CURVE, head_step=0.0)
    assert tau_without == pytest.approx(4 / 4)


def test_walk_merges_a_copy_into_a_tree_keeping_the_longer():
    # anchor 0: the tree keeps 2 (ranks 0, 0), the copy 1 of 1; anchor 3: the copy keeps 2 of 2, the tree none
    turn = [([0, 0], 1, 1), ([9], 0, 0), ([9], 0, 0), ([7, 7], 2, 2), ([9], 0, 0), ([9], 0, 0)]
    tree = {(0,), (0, 0)}
    tau, speed = ceiling.walk([turn], tree, CURVE, head_step=0.0, lookup="merge")
    assert tau == pytest.approx(6 / 2)  # 3 tokens at anchor 0 (the tree's 2 + 1), 3 at anchor 3 (the copy's 2 + 1)
    assert speed == pytest.approx(6 / (2 * CURVE[2]))  # max(2 nodes, copy) + 1 = 3 tokens a pass
    tau_replaced, _ = ceiling.walk([turn], tree, CURVE, head_step=0.0, lookup="replace")
    assert tau_replaced < tau  # replacing the tree by a copy of 1 loses the tree's 2 at anchor 0


def test_with_alpha_is_right_at_the_rate_asked():
    turns = [[([0, 0, 0], 0, 0)] * 2000]
    ranks = [r for ranks, _, _ in ceiling.with_alpha(turns, 0.7)[0] for r in ranks]
    assert sum(r == 0 for r in ranks) / len(ranks) == pytest.approx(0.7, abs=0.02)
