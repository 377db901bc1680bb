"""An independent draft model sharing the target's tokenizer."""

from __future__ import annotations

import functools

import torch

from ..config import SamplingParams
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..sampling import processed_probs, sample
from ..types import Draft
from .vocab import HasDraftVocab


class ModelDrafter(HasDraftVocab):
    """draft_vocab > 0: score only that many rows of the draft's LM head (drafters/vocab.py; native backend);
    None: auto (vocab.resolve_rows)."""

    name = "draft"
    catches_up = True  # a proposal feeds the draft model whatever it has not seen (sync_for_next)
    timed_price = True

    def __init__(self, draft: LoadedModel, target: LoadedModel, min_confidence: float = 0.0,
                 draft_vocab: int | None = None, context_tokens: int = 0):
        check_compatible_vocab(draft, target)
        self.min_confidence = min_confidence  # stop drafting when the draft's top-1 probability drops below
        # the draft model reads the context from `context_start` on: the prompt's last `context_tokens` (0: all)
        self.context_tokens = context_tokens
        self.context_start = 0
        self.draft = draft
        self.backend = draft.backend
        self.state = draft.new_state()
        self.score_rows(draft, draft_vocab)  # sets draft_bytes, read by gamma auto every pass


    def begin(self, prompt_ids: list[int], features=None) -> None:
        self.state = self.draft.new_state()
        self.rows_for_prompt(self.state, prompt_ids)
        self.context_start = prefill_window(self.state, prompt_ids, self.context_tokens)

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        window = min(prompt_len, self.context_tokens) if self.context_tokens else prompt_len
        return window + context_len - prompt_len  # the prompt's window, then everything generated since

    def propose(self, context_ids, k, params: SamplingParams, generator) -> Draft:
        to_feed = self.state.sync_for_next(context_ids[self.context_start:])
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        logits = self.state.forward(to_feed, 1)  # [1, V_draft]
        for i in range(k):
            if self.min_confidence and i > 0 and float(logits[0].softmax(-1).max()) < self.min_confidence:
                break  # an unsure draft is likely rejected; a shorter draft saves draft steps (still exact)
            if params.greedy:
                index = int(logits[0].argmax())
            else:
                probs = processed_probs(logits, params)  # [1, V_draft]; accept_rejection aligns widths
                index = int(sample(probs, generator))
                rows.append(probs[0])
            token = index if self.vocab is None else self.vocab.target_id(index)
            token_ids.append(token)
            if i + 1 < k:
                logits = self.state.forward([token], 1)
        draft_probs = torch.stack(rows) if rows else None  # [k, V_draft]
        if draft_probs is not None and self.vocab is not None:
            draft_probs = self.vocab.spread(draft_probs)  # [k, V]: q is 0 outside the rows drafted from
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs)

    def on_accept(self, context_ids: list[int], features=None) -> None:
        self.state.sync(context_ids[self.context_start:])  # drop rejected draft tokens; the new token is fed at the next propose


def prefill_window(state, prompt_ids: list[int], context_tokens: int) -> int:
    """A draft model's prefill of the prompt's last `context_tokens` (0: all of it), but the last token (fed with
    the first proposal). Returns the context index the draft's cache position 0 holds."""
    start = max(0, len(prompt_ids) - context_tokens) if context_tokens else 0
    if len(prompt_ids) - start > 1:
        state.forward(prompt_ids[start:-1], 1)
    return start


def check_compatible_vocab(draft: LoadedModel, target: LoadedModel) -> None:
    """One vocabulary must extend the other (same string -> same id on every shared entry); otherwise draft
    ids would mean different text to the target. Extra entries (e.g. added special tokens) are harmless: a
    draft id the target does not use gets p = 0 and is always rejected, which keeps the output exact."""
    sizes, differing = _vocabulary_mismatch(draft.tokenizer, target.tokenizer)
    if differing:
        raise SpecdraftError(
            f"draft {draft.name!r} and target {target.name!r} have incompatible vocabularies ({sizes[0]} vs "
            f"{sizes[1]} tokens, {differing} draft entries map differently); choose a draft with the "
            f"target's tokenizer, or use --method prompt-lookup")


@functools.lru_cache(maxsize=8)
def _vocabulary_mismatch(draft_tokenizer, target_tokenizer) -> tuple[tuple[int, int], int]:
    """((draft size, target size), draft entries that map differently, 0 when one vocabulary extends the other).
    Once per pair of tokenizers: get_vocab builds a dict of every entry (0.75 s for Qwen's 151,646, which every
    drafter of a server's pool paid when built)."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    draft_in_target = all(target_vocab.get(tok) == idx for tok, idx in draft_vocab.items())
    target_in_draft = all(draft_vocab.get(tok) == idx for tok, idx in target_vocab.items())
    differing = 0 if draft_in_target or target_in_draft else sum(
        target_vocab.get(tok) != idx for tok, idx in draft_vocab.items())
    return (len(draft_vocab), len(target_vocab)), differing
