"""The values that flow through the loop: a draft, its acceptance, and the statistics of a generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Draft:
    """What a drafter proposes for one target pass.

    token_ids:   [k] int64, the proposed continuation (k may be 0: plain autoregressive decoding).
    draft_probs: [k, V] float32, the distribution each token was sampled from; None means each token was
                 chosen deterministically (prompt lookup, greedy), i.e. q is one-hot on it.
    """

    token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class Acceptance:
    """Outcome of checking a draft of k tokens against one target pass.

    n_accepted: how many draft tokens were kept (a prefix of the draft).
    tokens:     [n_accepted + 1] the tokens to emit: the kept draft tokens, then either the *recovered*
                token (sampled from norm((p - q)+) at the first rejected position; the target's argmax under
                greedy) or, when all k were kept, the *bonus* token sampled from p at position k.
    """

    n_accepted: int
    tokens: list[int]


@dataclass
class SpecStats:
    """Statistics of one generation.

    acceptance_rate: accepted / drafted over all draft tokens.
    alpha:           per-token acceptance probability under the i.i.d. model, estimated as accepted / examined,
                     where a pass examines its accepted tokens plus the one it rejected (if any). It is the
                     estimate that makes predicted_tau comparable with the measured tau.
    tau:             emitted tokens per target pass, the recovered/bonus token included.
    predicted_tau:   (1 - alpha^(gamma+1)) / (1 - alpha), the expectation for that alpha and gamma.
    """

    method: str = "ar"
    gamma: int = 0
    backend: str = ""  # the target's forward: "native" or "transformers"
    draft_backend: str = ""  # the draft model's, when there is one
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    examined: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [gamma]: passes that kept position i
    drafted_per_position: list[int] = field(default_factory=list)  # [gamma]: passes that drafted position i
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_prefill_s: float = 0.0
    time_total_s: float = 0.0
    finish_reason: str = ""

    def record(self, draft_len: int, n_accepted: int) -> None:
        self.target_passes += 1
        self.drafted += draft_len
        self.accepted += n_accepted
        self.examined += min(draft_len, n_accepted + 1)
        if len(self.drafted_per_position) < draft_len:
            grow = draft_len - len(self.drafted_per_position)
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(draft_len):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < n_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined if self.examined else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def predicted_tau(self) -> float:
        if self.gamma == 0:
            return 1.0
        a = self.alpha
        return float(self.gamma + 1) if a >= 1.0 else (1 - a ** (self.gamma + 1)) / (1 - a)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def time_other_s(self) -> float:
        return max(0.0, self.time_total_s - self.time_draft_s - self.time_verify_s - self.time_prefill_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total_s if self.time_total_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("acceptance_rate", "alpha", "tau", "predicted_tau", "acceptance_per_position",
                     "time_other_s", "tokens_per_s"):
            out[name] = getattr(self, name)
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: SpecStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "stats": self.stats.to_dict()}
