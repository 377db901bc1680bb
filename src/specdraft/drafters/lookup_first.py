"""Prompt lookup first: copy drafts where the context repeats itself, another drafter's drafts elsewhere.

Answers that copy from their prompt (a summary, an answer over a passage, edited code) are drafted best by prompt
lookup: the copy costs nothing and is often right for several tokens. Where nothing repeats, or only a single
token does, a trained drafter (an EAGLE head, a draft model) guesses better. This wrapper asks prompt lookup first,
with n-grams of at least `min_ngram` tokens, and the wrapped drafter otherwise.

A tree drafter (one with a node `budget`: draft-tree, eagle-tree, sorted-tree) keeps drafting when a copy exists:
the copy becomes the tree's first branch and the drafter's own nodes fill the rest of the budget
(`with_copy_branch`), so the pass verifies the copy and the drafter's alternatives together. A chain drafter is
replaced by the copy.

Exact: which of the two proposes depends only on the context, and each draft carries the distribution it was
drawn from (a copy is deterministic, q one-hot; a merged tree only when the drafter's tree is deterministic too,
which the tree rule of acceptance.py needs). The wrapped drafter still sees every accepted token: a drafter
that skipped a pass catches up on its next proposal (a draft model feeds the missing tokens, an EAGLE head the
target features it was handed).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import SamplingParams
from ..types import Draft
from .base import Drafter, DraftTally, LabelTally, Tallies
from .prompt_lookup import NgramIndex

LOOKUP_LABEL = "lookup"


class LookupFirstDrafter(Drafter):
    """`inner` with prompt lookup in front; drafts are labelled "lookup" or with the inner drafter's name, so the
    statistics tally how many tokens each proposed and had accepted."""

    def __init__(self, inner: Drafter, max_ngram: int, min_ngram: int):
        self.inner = inner
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = f"{inner.name}+lookup"
        self.feature_layers = inner.feature_layers  # the engine taps these for the inner drafter
        self.budget = inner.budget  # a tree drafter's: the copy becomes its first branch
        # the context's n-grams; a pooled instance may serve another request next, before its `begin`: the index
        # starts afresh on a context that does not extend the one it holds
        self.index = NgramIndex(max_ngram, min_ngram)

    @property
    def draft_bytes(self) -> int:
        """A copy reads no weights; the wrapped drafter's draft reads its own (gamma auto counts those)."""
        return self.inner.draft_bytes

    @property
    def timed_price(self) -> bool:
        return self.inner.timed_price

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    @property
    def source_bytes(self) -> dict[str, int]:
        """Per source: a copy reads no weights (the wrapped drafter, the default source, reads draft_bytes)."""
        return {LOOKUP_LABEL: 0}

    def next_source(self, context_ids: list[int]) -> str | None:
        """LOOKUP_LABEL when the next proposal copies (for a chain drafter: the copy alone), None when the wrapped
        drafter proposes. A copy continues an earlier match whatever its length, so asking for one token tells."""
        return LOOKUP_LABEL if self._continuation(context_ids, 1) else None

    def _continuation(self, context_ids: list[int], k: int) -> list[int]:
        self.index.update(context_ids)
        return self.index.continuation(k)

    def statistics(self) -> dict[str, object]:
        return {**self.inner.statistics(), "lookup_first": self.min_ngram}

    def new_tally(self) -> DraftTally:
        """Its drafts are labelled (a copy, or the wrapped drafter's): counted per label; the wrapped drafter's own
        counters see every pass, copies included."""
        return Tallies(self.inner.new_tally(), LabelTally())

    @property
    def catches_up(self) -> bool:  # a copy needs no state: as the wrapped drafter
        return self.inner.catches_up

    @property
    def keeps_sequence_state(self) -> bool:
        return self.inner.keeps_sequence_state

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        return self.inner.catch_up_tokens(prompt_len, context_len)

    def reads_before_guess(self, context_ids: list[int], prompt_len: int, begun: bool) -> int:  # a copy: nothing
        if self.next_source(context_ids) == LOOKUP_LABEL:
            return 0
        return self.inner.reads_before_guess(context_ids, prompt_len, begun)

    def use_target_state(self, target_state) -> None:
        """Passed on to the wrapped drafter (drafters/base.py)."""
        self.inner.use_target_state(target_state)

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.inner.begin(prompt_ids, features)

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        copy = self._copy(context_ids, k)
        tree_budget = self.inner.budget
        if copy.k and tree_budget is None:
            return copy
        draft = self._labelled(self.inner.propose(context_ids, k, params, generator))
        if not copy.k:
            return draft
        return with_copy_branch(copy, draft, tree_budget) if draft.draft_probs is None else copy

    def _copy(self, context_ids: list[int], k: int) -> Draft:
        """Up to k tokens copied after the context's latest repeated n-gram (none: an empty draft)."""
        copied = self._continuation(context_ids, k) if k else []
        return Draft(torch.tensor(copied, dtype=torch.long), labels=[LOOKUP_LABEL] * len(copied))

    def _labelled(self, draft: Draft) -> Draft:
        """The wrapped drafter's draft, its tokens labelled with its name unless it labels them itself."""
        return draft if draft.labels is not None else replace(draft, labels=[self.inner.name] * draft.k)

    def batch_key(self) -> object | None:
        """As the wrapped drafter's, for a chain drafter (whose draft a copy replaces)."""
        own = type(self).propose is LookupFirstDrafter.propose
        return self.inner.batch_key() if own and self.inner.budget is None else None

    @classmethod
    def propose_batch(cls, drafters, contexts, ks, params, generators) -> list[Draft]:
        """The copies, and the wrapped drafters' drafts for the requests without one in one batch."""
        drafts = [drafter._copy(context, k) for drafter, context, k in zip(drafters, contexts, ks)]
        rest = [i for i, draft in enumerate(drafts) if not draft.k]
        if rest:
            inner = [drafters[i].inner for i in rest]
            for i, draft in zip(rest, type(inner[0]).propose_batch(inner, [contexts[i] for i in rest],
                                                                   [ks[i] for i in rest], [params[i] for i in rest],
                                                                   [generators[i] for i in rest])):
                drafts[i] = drafters[i]._labelled(draft)
        return drafts

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.inner.on_accept(context_ids, features)


def with_copy_branch(copy: Draft, tree: Draft, budget: int) -> Draft:
    """The copy (a chain) as the first branch, then the tree's nodes in their order, merged where they spell the
    same tokens, while max(budget, copy length) nodes last; a node whose parent did not fit is dropped. Both
    drafts must be deterministic (draft_probs None). Returns a tree Draft with both drafts' labels."""
    tokens: list[int] = []
    parents: list[int] = []
    labels: list[str] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def add(parent: int, token: int, label: str) -> int:
        node_of[(parent, token)] = len(tokens)
        tokens.append(token)
        parents.append(parent)
        labels.append(label)
        return len(tokens) - 1

    parent = -1
    for token, label in zip(copy.token_ids.tolist(), copy.labels):
        parent = add(parent, token, label)
    limit = max(budget, len(tokens))
    merged: list[int | None] = []  # the tree's node i -> its node in the result (None: dropped)
    for token, tree_parent, label in zip(tree.token_ids.tolist(), tree.parent_list, tree.labels):
        parent = -1 if tree_parent < 0 else merged[tree_parent]
        if parent is None:
            merged.append(None)
        elif (parent, token) in node_of:
            merged.append(node_of[(parent, token)])
        else:
            merged.append(add(parent, token, label) if len(tokens) < limit else None)
    return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long), labels)

