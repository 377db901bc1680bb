"""Acceptance rules: pure functions that decide which draft tokens to keep, with slow reference twins.

Words (as in vLLM's rejection sampler):
  accepted   a draft token kept because the target agrees with it;
  recovered  the token emitted at the first rejected position, drawn from norm((p - q)+);
  bonus      the token drawn from p after all k draft tokens were accepted.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) keeps draft token x_i with probability
min(1, p_i(x_i) / q_i(x_i)), left to right. Every emitted token is then distributed exactly as if the target
had sampled it alone. With q one-hot (a deterministic drafter) the rule keeps x with probability p(x) and
recovers from p with x removed.

Shapes: k draft tokens, V vocabulary entries; target_probs has k + 1 rows (the last one is the bonus row).
"""

from __future__ import annotations

import torch

from .sampling import sample
from .types import Acceptance


def accept_greedy(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> Acceptance:
    """Keep the longest draft prefix equal to the target's argmax, then emit the target's own next token.

    draft_ids:     [k] int64
    target_argmax: [k + 1] int64, the target's argmax at each verified position
    """
    k = draft_ids.shape[0]
    mismatch = (draft_ids != target_argmax[:k]).nonzero()
    n_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return Acceptance(n_accepted, target_argmax[: n_accepted + 1].tolist())


def accept_rejection(
    draft_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, V] float32, or None when q is one-hot on draft_ids
    target_probs: torch.Tensor,  # [k + 1, V] float32
    generator: torch.Generator | None,
) -> Acceptance:
    """Speculative rejection sampling, vectorised over the draft; see the module docstring."""
    k = draft_ids.shape[0]
    if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
        # vocabularies of different widths: the ids beyond a model's width have probability 0 under it
        width = max(draft_probs.shape[-1], target_probs.shape[-1])
        draft_probs = torch.nn.functional.pad(draft_probs, (0, width - draft_probs.shape[-1]))
        target_probs = torch.nn.functional.pad(target_probs, (0, width - target_probs.shape[-1]))
    positions = torch.arange(k)
    target_p_of_draft = target_probs[positions, draft_ids]  # [k]
    draft_q_of_draft = draft_probs[positions, draft_ids] if draft_probs is not None else torch.ones(k)  # [k]
    uniforms = torch.rand(k, generator=generator)  # [k]
    # u < p/q, written without the division; q(x) > 0 because x was sampled from q.
    keep = uniforms * draft_q_of_draft < target_p_of_draft  # [k] bool
    rejected = (~keep).nonzero()
    n_accepted = int(rejected[0, 0]) if rejected.numel() else k
    kept = draft_ids[:n_accepted].tolist()
    if n_accepted == k:
        bonus = sample(target_probs[k : k + 1], generator)
        return Acceptance(k, kept + [int(bonus)])
    target_row = target_probs[n_accepted]  # [V]
    if draft_probs is not None:
        draft_row = draft_probs[n_accepted]
    else:
        draft_row = torch.zeros_like(target_row)
        draft_row[draft_ids[n_accepted]] = 1.0
    residual = (target_row - draft_row).clamp_min(0.0)  # [V]
    if residual.sum() <= 0:  # p <= q everywhere means p == q: a rejection had probability 0 (rounding)
        residual = target_row
    recovered = sample((residual / residual.sum()).unsqueeze(0), generator)
    return Acceptance(n_accepted, kept + [int(recovered)])


def reference_accept_rejection(
    draft_ids: list[int],
    draft_probs: list[list[float]] | None,  # [k][V], None for one-hot
    target_probs: list[list[float]],  # [k + 1][V]
    generator: torch.Generator | None,
) -> Acceptance:
    """Slow twin of `accept_rejection`: one token at a time, plain Python arithmetic, same rule."""
    vocab = len(target_probs[0])
    emitted: list[int] = []
    for i, token in enumerate(draft_ids):
        q_row = draft_probs[i] if draft_probs is not None else [1.0 if v == token else 0.0 for v in range(vocab)]
        p_row = target_probs[i]
        u = float(torch.rand(1, generator=generator))
        if u < min(1.0, p_row[token] / q_row[token]):
            emitted.append(token)
            continue
        residual = [max(p - q, 0.0) for p, q in zip(p_row, q_row)]
        total = sum(residual)
        if total <= 0:
            residual, total = list(p_row), sum(p_row)
        emitted.append(_draw([r / total for r in residual], generator))
        return Acceptance(i, emitted)
    emitted.append(_draw(target_probs[len(draft_ids)], generator))
    return Acceptance(len(draft_ids), emitted)


def _draw(probs: list[float], generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from a Python list of probabilities."""
    u = float(torch.rand(1, generator=generator)) * sum(probs)
    cumulative = 0.0
    for token, prob in enumerate(probs):
        cumulative += prob
        if u < cumulative:
            return token
    return max(t for t, prob in enumerate(probs) if prob > 0)  # u fell past the end by rounding


def reference_accept_greedy(draft_ids: list[int], target_argmax: list[int]) -> Acceptance:
    """Slow twin of `accept_greedy`."""
    emitted = []
    for i, token in enumerate(draft_ids):
        if token != target_argmax[i]:
            return Acceptance(i, emitted + [target_argmax[i]])
        emitted.append(token)
    return Acceptance(len(draft_ids), emitted + [target_argmax[len(draft_ids)]])
