"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import torch

from ..types import Draft
from .base import Drafter


class PromptLookupDrafter(Drafter):
    """No model. Tries n-grams from max_ngram down to min_ngram; the draft is deterministic (q one-hot)."""

    name = "prompt-lookup"
    keeps_sequence_state = False  # requests decoded together share it: each context finds its own index
    catches_up = True
    # indexes kept, the most recently used first: a served request's lingers until 16 newer ones pushed it out
    # (1500 tokens: about 4,500 entries); more requests in flight than that index again as they come back
    max_sequences = 16

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.indexes: list[NgramIndex] = []

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        return 0  # indexing the context costs next to nothing against a pass

    def begin(self, prompt_ids: list[int], features=None) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        return Draft(torch.tensor(self.index_of(context_ids).continuation(k), dtype=torch.long))

    def index_of(self, context_ids: list[int]) -> NgramIndex:
        """context_ids indexed: the index of the sequence it extends (a request's earlier context), or a new one."""
        found = next((i for i, index in enumerate(self.indexes) if index.extended_by(context_ids)), None)
        index = NgramIndex(self.max_ngram, self.min_ngram) if found is None else self.indexes.pop(found)
        self.indexes.insert(0, index)
        del self.indexes[self.max_sequences:]
        index.update(context_ids)
        return index

    def on_accept(self, context_ids: list[int], features=None) -> None:
        pass


class NgramIndex:
    """The latest start of every n-gram (min_ngram..max_ngram tokens) of a sequence that has a token after it:
    `continuation` gives find_continuation's answer with a few dictionary lookups, and a sequence that grows is
    indexed once (its new n-grams only). A sequence that is not the indexed one extended is indexed afresh."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: list[int] = []  # the indexed sequence
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extended_by(self, context_ids: list[int]) -> bool:
        """Whether context_ids starts with the indexed sequence."""
        have = len(self.ids)  # the last token first: most foreign contexts fail there without a copy
        return len(context_ids) >= have and (not have or context_ids[have - 1] == self.ids[-1]) and (
            context_ids[:have] == self.ids)

    def update(self, context_ids: list[int]) -> None:
        """Index context_ids (prompt + everything emitted so far)."""
        have = len(self.ids)
        if not self.extended_by(context_ids):
            self.ids, have = [], 0
            for starts in self.latest.values():
                starts.clear()
        if len(context_ids) == have:
            return
        self.ids.extend(context_ids[have:])
        ids, length = self.ids, len(self.ids)
        for n, starts in self.latest.items():
            # starts whose n-gram now has a token after it: start + n < length, and was not indexed before
            for start in range(max(0, have - n), length - n):
                starts[tuple(ids[start:start + n])] = start

    def continuation(self, k: int) -> list[int]:
        """Up to k tokens after the latest earlier match of the longest matching suffix n-gram ([] if none)."""
        ids, length = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self.latest[n].get(tuple(ids[length - n:]))
            if start is not None:
                return ids[start + n:start + n + k]
        return []


def find_continuation(context_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up-to-k tokens after the most recent earlier match of the longest matching suffix n-gram (a scan of the
    whole context: NgramIndex's slow twin)."""
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
