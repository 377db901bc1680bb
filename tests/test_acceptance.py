"""Acceptance rules on hand-made distributions: forced outcomes, the reference twin, and exactness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdraft.acceptance import (accept_greedy, accept_rejection, reference_accept_greedy,
                                  reference_accept_rejection)
from specdraft.types import Acceptance


def onehot(index: int, width: int = 4) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(width)]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_accepts_all_and_adds_bonus():
    result = accept_greedy(torch.tensor([3, 1]), torch.tensor([3, 1, 2]))
    assert (result.n_accepted, result.tokens) == (2, [3, 1, 2])


def test_greedy_rejects_at_first_mismatch_and_emits_target_token():
    result = accept_greedy(torch.tensor([3, 0, 1]), torch.tensor([3, 1, 1, 2]))
    assert (result.n_accepted, result.tokens) == (1, [3, 1])


def test_greedy_empty_draft_is_one_autoregressive_step():
    result = accept_greedy(torch.empty(0, dtype=torch.long), torch.tensor([2]))
    assert (result.n_accepted, result.tokens) == (0, [2])


def test_rejection_accepts_all_when_target_agrees_and_samples_bonus():
    draft_ids = torch.tensor([1, 2])
    draft_probs = t([onehot(1), onehot(2)])
    target_probs = t([onehot(1), onehot(2), onehot(3)])
    result = accept_rejection(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert (result.n_accepted, result.tokens) == (2, [1, 2, 3])


def test_rejection_rejects_token_target_never_emits_and_recovers_from_residual():
    # position 1: target gives token 2 probability 0, so it must be rejected; residual (p - q)+ is one-hot on 0
    draft_ids = torch.tensor([1, 2])
    draft_probs = t([onehot(1), [0.0, 0.0, 1.0, 0.0]])
    target_probs = t([onehot(1), [1.0, 0.0, 0.0, 0.0], onehot(3)])
    for seed in range(20):
        result = accept_rejection(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert (result.n_accepted, result.tokens) == (1, [1, 0])


def test_rejection_with_one_hot_draft_recovers_without_the_rejected_token():
    draft_ids = torch.tensor([0])
    target_probs = t([[0.0, 0.5, 0.5, 0.0], onehot(3)])
    for seed in range(20):
        result = accept_rejection(draft_ids, None, target_probs, torch.Generator().manual_seed(seed))
        assert result.n_accepted == 0 and result.tokens[0] in (1, 2)


def test_fast_rule_matches_reference_twin_draw_for_draw():
    # Both consume the generator differently, so compare distributions of outcomes, not single draws.
    rng = np.random.default_rng(0)
    k, vocab, n = 3, 5, 20_000
    draft_probs = t(rng.dirichlet(np.ones(vocab), size=k))
    target_probs = t(rng.dirichlet(np.ones(vocab), size=k + 1))
    draft_ids = torch.tensor([0, 1, 2])
    fast = _outcome_counts(lambda g: accept_rejection(draft_ids, draft_probs, target_probs, g), n, seed=1)
    slow = _outcome_counts(lambda g: reference_accept_rejection(draft_ids.tolist(), draft_probs.tolist(),
                                                                target_probs.tolist(), g), n, seed=2)
    keys = sorted(set(fast) | set(slow))
    tv = 0.5 * sum(abs(fast.get(key, 0) - slow.get(key, 0)) for key in keys) / n
    assert tv < 0.03, f"fast and reference rules disagree: total variation {tv:.3f} over {n} draws"


def test_greedy_reference_twin_agrees_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(200):
        draft = rng.integers(0, 3, size=4).tolist()
        target = rng.integers(0, 3, size=5).tolist()
        fast = accept_greedy(torch.tensor(draft), torch.tensor(target))
        assert fast == reference_accept_greedy(draft, target)


def _outcome_counts(rule, n: int, seed: int) -> dict[tuple, int]:
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        result = rule(generator)
        key = (result.n_accepted, result.tokens[-1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def always_accept(draft_ids, draft_probs, target_probs, generator) -> Acceptance:
    """Deliberately wrong rule (negative control): keeps every draft token."""
    k = draft_ids.shape[0]
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Acceptance(k, draft_ids.tolist() + [bonus])


def resample_from_target(draft_ids, draft_probs, target_probs, generator) -> Acceptance:
    """Deliberately wrong rule (negative control): on rejection, samples from p instead of norm((p - q)+)."""
    k = draft_ids.shape[0]
    u = torch.rand(k, generator=generator)
    for i in range(k):
        token = int(draft_ids[i])
        if u[i] * draft_probs[i, token] >= target_probs[i, token]:
            recovered = int(torch.multinomial(target_probs[i], 1, generator=generator))
            return Acceptance(i, draft_ids[:i].tolist() + [recovered])
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Acceptance(k, draft_ids.tolist() + [bonus])


def first_token_pvalue(rule, n: int, seed: int) -> float:
    """Draw a draft token from q, apply the rule, and chi-square the first emitted token against p."""
    draft_row = torch.tensor([0.6, 0.2, 0.1, 0.1])
    target_row = torch.tensor([0.1, 0.3, 0.4, 0.2])
    target_probs = torch.stack([target_row, target_row])  # [k + 1 = 2, V]
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(4)
    for _ in range(n):
        draft_id = torch.multinomial(draft_row, 1, generator=generator)  # [1]
        result = rule(draft_id, draft_row.unsqueeze(0), target_probs, generator)
        counts[result.tokens[0]] += 1
    return chisquare(counts, target_row.numpy() * n).pvalue


# Sample size 4000 and threshold 1e-3: the exact rule passes with probability 0.999; the wrong rules put
# 0.6 of the first token's mass on token 0 (always accept) or 0.16 too much (resample from p), which a chi-square
# test at this size detects with p-values far below 1e-10.
N_SAMPLES, P_THRESHOLD = 4000, 1e-3


@pytest.mark.parametrize("rule", [accept_rejection, lambda *a: reference_accept_rejection(
    a[0].tolist(), a[1].tolist(), a[2].tolist(), a[3])], ids=["fast", "reference"])
def test_first_token_follows_target_distribution(rule):
    assert first_token_pvalue(rule, N_SAMPLES, seed=0) > P_THRESHOLD


@pytest.mark.parametrize("wrong_rule", [always_accept, resample_from_target])
def test_negative_control_wrong_rules_fail_the_same_test(wrong_rule):
    assert first_token_pvalue(wrong_rule, N_SAMPLES, seed=0) < P_THRESHOLD
