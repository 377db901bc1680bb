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
    """One token per row. probs: [n, V] float32. Returns ids [n] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
