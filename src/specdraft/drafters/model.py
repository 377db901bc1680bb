"""An independent draft model sharing the target's tokenizer."""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..sampling import processed_probs, sample
from ..types import Draft


class ModelDrafter:
    name = "draft"

    def __init__(self, draft: LoadedModel, target: LoadedModel, min_confidence: float = 0.0):
        check_compatible_vocab(draft, target)
        self.min_confidence = min_confidence  # stop drafting when the draft's top-1 probability drops below
        self.draft = draft
        self.backend = draft.backend  # shown in the statistics
        self.state = draft.new_state()

    def begin(self, prompt_ids: list[int], features=None) -> None:
        self.state = self.draft.new_state()
        if len(prompt_ids) > 1:
            self.state.forward(prompt_ids[:-1], 1)

    def propose(self, context_ids, k, params: SamplingParams, generator) -> Draft:
        to_feed = self.state.sync_for_next(context_ids)
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        logits = self.state.forward(to_feed, 1)  # [1, V_draft]
        for i in range(k):
            if self.min_confidence and i > 0 and float(logits[0].softmax(-1).max()) < self.min_confidence:
                break  # an unsure draft is likely rejected; a shorter draft saves draft steps (still exact)
            if params.greedy:
                token = int(logits[0].argmax())
            else:
                probs = processed_probs(logits, params)  # [1, V_draft]; accept_rejection aligns widths
                token = int(sample(probs, generator))
                rows.append(probs[0])
            token_ids.append(token)
            if i + 1 < k:
                logits = self.state.forward([token], 1)
        draft_probs = torch.stack(rows) if rows else None  # [k, V_draft]
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs)

    def on_accept(self, context_ids: list[int], features=None) -> None:
        self.state.sync(context_ids)  # drop rejected draft tokens; the new token is fed at the next propose


def check_compatible_vocab(draft: LoadedModel, target: LoadedModel) -> None:
    """One vocabulary must extend the other (same string -> same id on every shared entry); otherwise draft
    ids would mean different text to the target. Extra entries (e.g. added special tokens) are harmless: a
    draft id the target does not use gets p = 0 and is always rejected, which keeps the output exact."""
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    draft_in_target = all(target_vocab.get(tok) == idx for tok, idx in draft_vocab.items())
    target_in_draft = all(draft_vocab.get(tok) == idx for tok, idx in target_vocab.items())
    if not (draft_in_target or target_in_draft):
        differing = sum(target_vocab.get(tok) != idx for tok, idx in draft_vocab.items())
        raise SpecdraftError(
            f"draft {draft.name!r} and target {target.name!r} have incompatible vocabularies ({len(draft_vocab)} vs "
            f"{len(target_vocab)} tokens, {differing} draft entries map differently); choose a draft with the "
            f"target's tokenizer, or use --method prompt-lookup")
