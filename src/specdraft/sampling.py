"""Logits to the processed distribution that tokens are drawn from: one function, used for p and for q alike.

The acceptance rule is exact only if q is the distribution the drafter really sampled from and p the
distribution the target alone would sample from; both come from `processed_probs` with the same settings.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax.

    logits: [n, V] (any float dtype). Returns float32 probabilities [n, V] whose rows sum to 1.
    Greedy (temperature 0) returns the one-hot of the argmax, so greedy is the limit of sampling.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)  # [n, V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; keep a token while that mass is below top_p (the top token is always kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, by inverse CDF. probs: [n, V], nonnegative, rows need not sum to 1. Returns ids [n]
    (int64).

    Token i is drawn when a uniform draw over [0, row total) lands in [cdf[i - 1], cdf[i]), an interval of
    width probs[i] (summed in float64, so rounding is far below any test's resolution); a zero-probability token
    has an empty interval and is never drawn. Same distribution as torch.multinomial, which on CPU costs 30-60x
    more over a 152k vocabulary (docs/performance.md "Sampling one token"): a sampled pass draws once per draft token
    and once at the target."""
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    draws = torch.rand(cdf.shape[0], 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]  # [n, 1]
    ids = torch.searchsorted(cdf, draws, right=True).squeeze(-1)  # [n]
    # a draw that rounds up to the row total: the last token with probability > 0 (its interval ends there)
    over = ids >= cdf.shape[-1]
    if over.any():
        last_positive = cdf.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # [n]
        ids = torch.where(over, last_positive, ids)
    return ids
