"""How many tokens to draft in each pass: a fixed gamma, or one chosen from the request's acceptance so far and the
target's measured verify-cost curve (`gamma=auto`).

The choice maximises expected tokens per unit of time,

    tau(alpha, k) / (T(k + 1) / T(1) + k * c),      tau(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha),

where T(n) is one target pass over n tokens (models/verify_curve.py measures it once per machine and model), c a
draft token's cost as a fraction of T(1), and alpha the per-token acceptance estimated from this request's passes
so far (a geometric chain: each pass examines its accepted tokens plus the one it rejected, if any). Recent passes
weigh more (`decay`), and a prior stands in for the first passes.

Exactness: the length of a pass's draft depends only on the passes before it, never on the target's
distribution at the positions being drafted, so the output keeps the target's distribution (greedy: the same
tokens) whatever length is chosen. A seeded request is reproducible on one machine: the curve is measured
once and cached, and the acceptance history is itself seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a pass emits on average with k draft tokens each accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, pass_cost: Sequence[float], draft_cost: float) -> int:
    """The k in 1..len(pass_cost) - 1 with the most expected tokens per unit of time.

    pass_cost[n - 1]: T(n) / T(1), a target pass over n tokens relative to one (pass_cost[0] == 1).
    draft_cost: one draft token's cost relative to T(1)."""
    candidates = range(1, len(pass_cost))
    return max(candidates, key=lambda k: (expected_tokens(alpha, k) / (pass_cost[k] + k * draft_cost), -k))


class DraftLength(Protocol):
    """One request's draft-length policy: `next` before each pass, `observe` after it; `most` bounds `next`."""

    most: int

    def next(self) -> int:
        """Draft tokens to ask for in the coming pass (the engine caps it by the tokens left)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """The pass drafted this many tokens (a chain) and the target kept this many of them."""


@dataclass
class FixedLength:
    gamma: int

    @property
    def most(self) -> int:
        return self.gamma

    def next(self) -> int:
        return self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class AdaptiveLength:
    """gamma=auto: the k of `best_length` for the acceptance seen so far in this request."""

    pass_cost: tuple[float, ...]  # [max_len + 1]: T(n) / T(1) for n = 1 .. max_len + 1
    draft_cost: float  # a draft token's cost relative to T(1)
    prior_alpha: float = 0.6  # stands in for the first passes: worth `prior_weight` examined tokens
    prior_weight: float = 2.0
    decay: float = 0.75  # each pass multiplies the weight of older ones by this (half-life 2.4 passes)
    accepted: float = 0.0
    examined: float = 0.0

    @property
    def most(self) -> int:
        return len(self.pass_cost) - 1

    @property
    def alpha(self) -> float:
        return ((self.accepted + self.prior_alpha * self.prior_weight)
                / (self.examined + self.prior_weight))

    def next(self) -> int:
        return best_length(self.alpha, self.pass_cost, self.draft_cost)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # nothing was drafted (e.g. prompt lookup found no match): no evidence either way
            return
        self.accepted = self.decay * self.accepted + accepted
        self.examined = self.decay * self.examined + min(drafted, accepted + 1)
