"""EAGLE-3-style drafting: a small head reads the target's hidden states and drafts a chain of gamma tokens.

Bookkeeping, with the engine's cache convention (the target has cached every token but the pending last one):
- the head's cache has one row per target position i, computed from the target's taps at i and the token
  after i; rows built from true taps are *committed*;
- the taps of newly cached target positions arrive through `begin` / `on_accept` and wait in `pending` until
  the next `propose` feeds them (so the head's work is counted as drafting time);
- a draft step past the last committed row feeds the head's own previous output with the token it just drafted;
  those rows are dropped (a length change) when the target reports what it kept.

The head's distribution is over its reduced vocabulary; `draft_probs` is spread back over the target's full
vocabulary with probability 0 outside the reduced set, so the acceptance rule stays exact.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..models.adapter import LoadedModel
from ..models.eagle_head import EagleHead, HeadCache, load_head
from ..sampling import processed_probs, sample
from ..types import Draft


class EagleDrafter:
    name = "eagle"
    backend = "eagle-head"

    def __init__(self, head: EagleHead, target: LoadedModel):
        self.head = head.eval()
        self.feature_layers = tuple(head.config.target_layers)  # the target taps the engine keeps for us
        self.cache = HeadCache(head.config)
        self.committed = 0  # head rows built from the target's own taps
        self.pending = torch.empty(0, head.config.hidden_size)  # [n, D] fused taps not yet fed to the head

    @classmethod
    def load(cls, name_or_path: str, target: LoadedModel) -> "EagleDrafter":
        return cls(load_head(name_or_path, target), target)

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.cache = HeadCache(self.head.config, capacity=len(prompt_ids) + 64)
        self.committed = 0
        self.pending = torch.empty(0, self.head.config.hidden_size)
        self._add(features)

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.cache.truncate(self.committed)  # drop the rows of speculative steps
        self._add(features)

    def _add(self, features: torch.Tensor | None) -> None:
        """features [n, 3, D_t]: taps of the next n target positions."""
        if features is not None and features.shape[0]:
            with torch.inference_mode():
                self.pending = torch.cat([self.pending, self.head.fuse(features)])  # [n_pending, D]

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        n_pending = self.pending.shape[0]
        # every target pass reports at least one new position; none pending means a one-token prompt
        if k == 0 or n_pending == 0:
            return Draft(torch.empty(0, dtype=torch.long))
        head = self.head
        with torch.inference_mode():
            self.cache.truncate(self.committed)
            # the token after each pending position; the last one is the pending token context_ids[-1]
            next_ids = torch.tensor(context_ids[self.committed + 1: self.committed + 1 + n_pending])  # [n]
            hidden = head.step(self.pending, next_ids, self.cache)[-1:]  # [1, D]
            self.committed += n_pending
            self.pending = self.pending[:0]
            token_ids: list[int] = []
            rows: list[torch.Tensor] = []
            for i in range(k):
                logits = head.full_vocab_logits(head.draft_logits(hidden))  # [1, V], -inf outside the draft vocab
                if params.greedy:
                    token = int(logits[0].argmax())
                else:
                    probs = processed_probs(logits, params)  # [1, V]
                    token = int(sample(probs, generator))
                    rows.append(probs[0])
                token_ids.append(token)
                if i + 1 < k:
                    hidden = head.step(hidden, torch.tensor([token]), self.cache)  # [1, D], a speculative row
        draft_probs = torch.stack(rows) if rows else None  # [k, V]
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs)
