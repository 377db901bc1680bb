"""How many tokens to draft in each pass: a fixed gamma, or one chosen from the request's acceptance so far and the
target's measured verify-cost curve (`gamma=auto`).

The choice maximises expected tokens per unit of time,

    tau(alpha, k) / (T(k + 1) / T(1) + k * c),      tau(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha),

where T(n) is one target pass over n tokens after the request's context so far (models/verify_curve.py measures
it once per machine and model, after a short and a long context, and `VerifyCurve.at` interpolates), c a
draft token's cost as a fraction of T(1), and alpha the per-token acceptance estimated from this request's passes
so far (a geometric chain: each pass examines its accepted tokens plus the one it rejected, if any). Recent passes
weigh more (`decay`), and a prior stands in for the first passes. k ranges over 0 .. most: k = 0, a plain target
pass, wins where drafting costs more than it saves (a costly drafter on text it guesses badly). A source rests
only on evidence, never on the prior alone, and forgets that evidence pass by pass while it rests, so it tries
again (one token) once the evidence has faded; in a pass shared with other requests (a server's batch) it does
not try: there the prior decides.

Several requests in one pass (`PassLoad`): the other requests' tokens sit on the curve first, and the choice
maximises the whole pass's expected tokens per unit of time (`best_length`). There a draft model that must first
read several tokens it has not seen (its window when it begins, or what went by while it rested) charges that
read to drafting at all (`read_cost`): every request in the pass waits for it. Alone, the read is left to the
measured token cost, as before (priced there too, a replay changed nothing: docs/performance.md).

Exactness: the length of a pass's draft depends only on the passes before it, never on the target's
distribution at the positions being drafted, so the output keeps the target's distribution (greedy: the same
tokens) whatever length is chosen. A seeded request is reproducible on one machine: the curve is measured
once and cached, and the acceptance history is itself seeded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a pass emits on average with k draft tokens each accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_over_passes(alpha: float, passes: int, drafted_per_position: Sequence[int]) -> float:
    """expected_tokens averaged over passes of different lengths: drafted_per_position[i] counts the passes that
    drafted at least i + 1 tokens, so the passes of exactly k tokens are the difference of two neighbours."""
    if not passes:
        return 1.0
    at_least = [passes, *drafted_per_position, 0]  # at_least[k]: passes that drafted k tokens or more
    return sum((at_least[k] - at_least[k + 1]) * expected_tokens(alpha, k)
               for k in range(len(at_least) - 1)) / passes


@dataclass(frozen=True)
class PassLoad:
    """What the other requests of a batched target pass put into it: their tokens (pending token and draft
    each), the tokens they emit at least (one each), and their drafts' cost relative to T(1)."""

    tokens: int = 0
    requests: int = 0
    draft_cost: float = 0.0

    def __add__(self, other: PassLoad) -> PassLoad:
        return PassLoad(self.tokens + other.tokens, self.requests + other.requests,
                        self.draft_cost + other.draft_cost)

    def __sub__(self, other: PassLoad) -> PassLoad:
        return PassLoad(self.tokens - other.tokens, self.requests - other.requests,
                        self.draft_cost - other.draft_cost)


def pass_cost_at(pass_cost: Sequence[float], n: int) -> float:
    """T(n) / T(1) from a curve measured for n = 1 .. len(pass_cost); past its end, a straight line through its
    last two points (a pass that long is bound by arithmetic, which grows linearly with its tokens)."""
    if n <= len(pass_cost):
        return pass_cost[n - 1]
    slope = pass_cost[-1] - pass_cost[-2] if len(pass_cost) > 1 else 1.0
    return pass_cost[-1] + (n - len(pass_cost)) * max(slope, 0.0)


def best_length(alpha: float, pass_cost: Sequence[float], draft_cost: float, load: PassLoad = PassLoad(),
                read_cost: float = 0.0) -> int:
    """The k in 0..len(pass_cost) - 1 with the most expected tokens per unit of time; 0 (a plain target pass,
    one token per T(1)) when no draft pays for its own steps and its extra verified rows.

    pass_cost[n - 1]: T(n) / T(1), a target pass over n tokens relative to one (pass_cost[0] == 1).
    draft_cost: one draft token's cost relative to T(1). load: the other requests in the same pass; the pass's
    tokens per unit of time counts theirs too, so a fuller pass (whose extra rows cost more) drafts less, and
    k = 0 keeps the pass as it would be without this request's draft. read_cost: what drafting at all costs
    first, relative to T(1), whatever k."""
    candidates = range(0, len(pass_cost))

    def tokens_per_time(k: int) -> float:
        spent = pass_cost_at(pass_cost, load.tokens + 1 + k) + load.draft_cost + k * draft_cost
        spent += read_cost if k else 0.0
        return (load.requests + expected_tokens(alpha, k)) / spent

    return max(candidates, key=lambda k: (tokens_per_time(k), -k))


# a draft model reading n tokens in one pass costs about 1 + READ_SLOPE (n - 1) of its one-token steps (the 0.5B, 2
# threads: 4 / 8 / 16 tokens 1.5 / 2.5 / 4.4 steps on the Zen 3, 4 and 16 tokens 1.45 and 3.8 on the Zen 4;
# docs/performance.md)
READ_SLOPE = 0.2


def read_cost(token_cost: float, reads: int) -> float:
    """What reading `reads` tokens before a guess costs beyond the one-token step that `token_cost` prices."""
    return token_cost * READ_SLOPE * max(reads - 1, 0)


EXTRAPOLATED_SPANS = 8.0  # VerifyCurve.at: the farthest it extrapolates, in spans between its two contexts


@dataclass(frozen=True)
class VerifyCurve:
    """T(n) / T(1) for n = 1 .. max_tokens, measured after `short_context` and after `long_context` cached tokens."""

    short: tuple[float, ...]
    long: tuple[float, ...]
    short_context: int = 64
    long_context: int = 512

    @classmethod
    def flat(cls, relative: Sequence[float]) -> VerifyCurve:
        """The same curve at every context length."""
        relative = tuple(relative)
        return cls(relative, relative)

    def at(self, context_tokens: int) -> tuple[float, ...]:
        """The curve after `context_tokens` cached tokens: linear in the context, never below the short curve,
        and never falling with n. Past the long context it extrapolates up to EXTRAPOLATED_SPANS spans, so
        that timing noise between the two curves is not magnified without bound."""
        span = max(self.long_context - self.short_context, 1)
        weight = min(max(context_tokens - self.short_context, 0) / span, EXTRAPOLATED_SPANS)
        curve, highest = [], 0.0
        for short, long in zip(self.short, self.long):
            highest = max(highest, short + weight * max(long - short, 0.0))
            curve.append(highest)
        return tuple(curve)


class DraftLength(Protocol):
    """One request's draft-length policy: `next` before each pass, `observe` after it; `most` bounds `next`.
    `source` names who drafts the pass when a drafter has several (lookup first: a copy or the wrapped drafter,
    the drafter's `next_source`); None for a drafter with one. `context_tokens`: the sequence so far, which
    the verify pass attends over."""

    most: int

    def next(self, source: str | None = None, context_tokens: int = 0, load: PassLoad = PassLoad(),
             reads: int = 1) -> int:
        """Draft tokens to ask for in the coming pass (the engine caps it by the tokens left); `load`: what other
        requests put into the same pass; `reads`: the tokens the drafter would first read
        (`Drafter.reads_before_guess`)."""

    def token_cost(self, source: str | None = None) -> float:
        """A draft token's cost relative to a one-token target pass, as this policy prices it."""

    def observe(self, drafted: int, accepted: int, source: str | None = None) -> None:
        """The pass drafted this many tokens (a chain) and the target kept this many of them."""


@dataclass
class FixedLength:
    gamma: int

    @property
    def most(self) -> int:
        return self.gamma

    def next(self, source: str | None = None, context_tokens: int = 0, load: PassLoad = PassLoad(),
             reads: int = 1) -> int:
        return self.gamma

    def token_cost(self, source: str | None = None) -> float:
        return 0.0  # a fixed length does not price its drafts

    def observe(self, drafted: int, accepted: int, source: str | None = None) -> None:
        pass


@dataclass
class Tally:
    """Decayed counts of one source's accepted and examined draft tokens."""

    accepted: float = 0.0
    examined: float = 0.0


@dataclass
class AdaptiveLength:
    """gamma=auto: the k of `best_length` for the acceptance seen so far in this request, kept apart per source
    (a prompt-lookup copy is accepted far more often than a model's guess, and costs nothing to draft)."""

    curve: VerifyCurve  # T(n) / T(1) for n = 1 .. max_len + 1, by context length
    source_costs: dict[str, float]  # a draft token's cost relative to T(1), for sources that cost otherwise
    # the default source's, read before every pass (a drafter's token cost may follow the request: the sorted
    # draft's exits)
    draft_cost: Callable[[], float]
    prior_alpha: float = 0.6  # stands in for the first passes: worth `prior_weight` examined tokens
    prior_weight: float = 2.0
    decay: float = 0.75  # each pass multiplies the weight of the source's older ones by this (half-life 2.4)
    tallies: dict[str | None, Tally] = field(default_factory=dict)
    # sources whose last `next` chose k = 0: each pass they rest decays their tally by rest_decay; a source rests
    # only on rest_evidence examined tokens or more, and drafts one token to find out otherwise
    resting: set[str | None] = field(default_factory=set)
    rest_decay: float = 0.9
    rest_evidence: float = 1.0

    @property
    def most(self) -> int:
        return len(self.curve.short) - 1

    def alpha(self, source: str | None = None) -> float:
        tally = self.tallies.get(source, Tally())
        return (tally.accepted + self.prior_alpha * self.prior_weight) / (tally.examined + self.prior_weight)

    def token_cost(self, source: str | None = None) -> float:
        return self.source_costs[source] if source in self.source_costs else self.draft_cost()

    def next(self, source: str | None = None, context_tokens: int = 0, load: PassLoad = PassLoad(),
             reads: int = 1) -> int:
        cost = self.token_cost(source)
        length = best_length(self.alpha(source), self.curve.at(context_tokens), cost, load,
                             read_cost(cost, reads) if load.requests else 0.0)
        if length == 0 and self.tallies.get(source, Tally()).examined < self.rest_evidence and not load.requests:
            length = 1  # too little evidence to rest on: one token finds out (alone in the pass: in a shared one,
            # finding out costs every request in it, and the prior is what the choice rests on)
        if length == 0:
            self.resting.add(source)
        else:
            self.resting.discard(source)
        return length

    def observe(self, drafted: int, accepted: int, source: str | None = None) -> None:
        if drafted == 0:  # nothing was drafted: no evidence either way (e.g. prompt lookup found no match)
            if source in self.resting and source in self.tallies:  # ... or this policy chose not to draft
                tally = self.tallies[source]
                tally.accepted, tally.examined = self.rest_decay * tally.accepted, self.rest_decay * tally.examined
            return
        tally = self.tallies.setdefault(source, Tally())
        tally.accepted = self.decay * tally.accepted + accepted
        tally.examined = self.decay * tally.examined + min(drafted, accepted + 1)
