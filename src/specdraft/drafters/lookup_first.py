"""Prompt lookup first: copy drafts where the context repeats itself, another drafter's drafts elsewhere.

Answers that copy from their prompt (a summary, an answer over a passage, edited code) are drafted best by prompt
lookup: the copy costs nothing and is often right for several tokens. Where nothing repeats, or only a single
token does, a trained drafter (an EAGLE head, a draft model) guesses better. This wrapper asks prompt lookup first,
with n-grams of at least `min_ngram` tokens, and the wrapped drafter otherwise.

Exact: which of the two proposes depends only on the context, and each draft carries the distribution it was
drawn from (a copy is deterministic, q one-hot). The wrapped drafter still sees every accepted token: a drafter
that skipped a pass catches up on its next proposal (a draft model feeds the missing tokens, an EAGLE head the
target features it was handed).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import SamplingParams
from ..types import Draft
from .base import Drafter
from .prompt_lookup import find_continuation

LOOKUP_LABEL = "lookup"


class LookupFirstDrafter:
    """`inner` with prompt lookup in front; drafts are labelled "lookup" or with the inner drafter's name, so the
    statistics tally how many tokens each proposed and had accepted."""

    def __init__(self, inner: Drafter, max_ngram: int, min_ngram: int):
        self.inner = inner
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = f"{inner.name}+lookup"
        self.feature_layers = getattr(inner, "feature_layers", ())  # the engine taps these for the inner drafter
        self.backend = getattr(inner, "backend", "")

    @property
    def vocab_rows(self) -> int:
        return getattr(self.inner, "vocab_rows", 0)

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.inner.begin(prompt_ids, features)

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        copied = find_continuation(context_ids, k, self.max_ngram, self.min_ngram) if k else []
        if copied:
            return Draft(torch.tensor(copied, dtype=torch.long), labels=[LOOKUP_LABEL] * len(copied))
        draft = self.inner.propose(context_ids, k, params, generator)
        return draft if draft.labels is not None else replace(draft, labels=[self.inner.name] * draft.k)

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.inner.on_accept(context_ids, features)
