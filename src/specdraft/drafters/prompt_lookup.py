"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import torch

from ..types import Draft
from .base import Drafter


class PromptLookupDrafter(Drafter):
    """No model. Tries n-grams from max_ngram down to min_ngram; the draft is deterministic (q one-hot)."""

    name = "prompt-lookup"
    keeps_sequence_state = False  # every proposal searches the context it is given
    catches_up = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        return 0  # it keeps no state: the context is searched as it is

    def begin(self, prompt_ids: list[int], features=None) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        return Draft(torch.tensor(find_continuation(context_ids, k, self.max_ngram, self.min_ngram),
                                  dtype=torch.long))

    def on_accept(self, context_ids: list[int], features=None) -> None:
        pass


def find_continuation(context_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up-to-k tokens after the most recent earlier match of the longest matching suffix n-gram."""
    length = len(context_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context_ids[length - n:]
        # latest start first, excluding the suffix itself
        for start in range(length - n - 1, -1, -1):
            if context_ids[start:start + n] == suffix:
                continuation = context_ids[start + n:start + n + k]
                if continuation:
                    return continuation
    return []
