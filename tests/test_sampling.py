"""`sample`, the one draw every sampled token goes through: it follows the given distribution (chi-square, with a
plausible wrong sampler as the negative control), never draws a zero-probability token, and handles a draw
that rounds up to the row total."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdraft import sampling
from specdraft.sampling import sample

# two rows over 6 tokens, unnormalised (a residual max(p - q, 0) is sampled before dividing by its sum in some
# callers), with zero-probability tokens at the start, the middle and the end
ROWS = torch.tensor([[0.0, 0.5, 0.25, 0.0, 1.25, 0.0],
                     [0.3, 0.0, 0.0, 0.1, 0.1, 0.5]], dtype=torch.float32)  # [2, 6]


def unscaled_draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Negative control: the inverse CDF with the draw left in [0, 1) instead of scaled to the row total."""
    cdf = probs.double().cumsum(dim=-1)
    draws = torch.rand(cdf.shape[0], 1, dtype=torch.float64, generator=generator)
    return torch.searchsorted(cdf, draws, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def pvalues(sampler, n: int = 6000) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(ROWS.shape, dtype=float)
    for _ in range(n):
        ids = sampler(ROWS, generator)  # [2]
        counts[np.arange(len(ids)), ids.numpy()] += 1
    result = []
    for row, observed in zip(ROWS, counts):
        expected = (row / row.sum()).double().numpy() * n
        if (observed[expected == 0] > 0).any():
            result.append(0.0)  # drew a token of probability 0
            continue
        result.append(float(chisquare(observed[expected > 0], expected[expected > 0]).pvalue))
    return result


@pytest.mark.parametrize("sampler, follows", [(sample, True), (unscaled_draw, False), (
    lambda probs, g: torch.multinomial(probs, 1, generator=g).squeeze(-1), True)], ids=["ours", "unscaled", "torch"])
def test_draws_follow_the_row_distribution(sampler, follows):
    """ours and torch.multinomial pass; the unscaled draw (a plausible bug) must fail the same test."""
    assert (min(pvalues(sampler)) > 1e-3) == follows


def test_a_draw_at_the_row_total_takes_the_last_token_with_probability(monkeypatch):
    monkeypatch.setattr(sampling.torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=torch.float64))
    assert sample(ROWS, None).tolist() == [4, 5]
    monkeypatch.setattr(sampling.torch, "rand", lambda *shape, **kw: torch.zeros(*shape, dtype=torch.float64))
    assert sample(ROWS, None).tolist() == [1, 0]  # a draw at 0 skips the leading zero-probability token
