"""An independent draft model sharing the target's tokenizer."""

from __future__ import annotations

import functools

import torch

from ..config import SamplingParams
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel, NativeState
from ..models.model_files import FastTokenizer
from ..models.native.llama import MAX_KERNEL_ROWS
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
        # the draft model reads the context from `context_start` on: the prompt's last `context_tokens` (0: all), and
        # after a rest in which more than that went by unseen, the context's last `context_tokens` (`window_feed`)
        self.context_tokens = context_tokens
        self.context_start = 0
        self.draft = draft
        self.backend = draft.backend
        self.state = draft.new_state()
        self.score_rows(draft, draft_vocab)  # sets draft_bytes, read by gamma auto every pass
        # a draft reading the whole context needs room for all of it (one reading a window of it: no limit of its own)
        self.max_positions = None if context_tokens else draft.max_positions


    def begin(self, prompt_ids: list[int], features=None) -> None:
        self.state = self.draft.new_state()
        self.rows_for_prompt(self.state, prompt_ids)
        self.context_start = window_start(prompt_ids, self.context_tokens)

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        if self.context_tokens:
            return min(self.context_tokens, context_len)  # the window of what it has not seen
        return context_len  # the whole prompt, then everything generated since

    def propose(self, context_ids, k, params: SamplingParams, generator) -> Draft:
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        logits = self.state.forward(self.to_feed(context_ids), 1)  # [1, V_draft]
        for i in range(k):
            if not self._pick(logits, i, params, generator, token_ids, rows):
                break
            if i + 1 < k:
                logits = self.state.forward(token_ids[-1:], 1)
        return self._draft(token_ids, rows)

    def reads_before_guess(self, context_ids: list[int], prompt_len: int, begun: bool) -> int:
        if not begun:
            return self.catch_up_tokens(prompt_len, len(context_ids))
        # what `to_feed` would feed now, without feeding it
        return len(window_feed(self.state, self.readable(context_ids), self.context_start, self.context_tokens,
                               dry_run=True)[0])

    def to_feed(self, context_ids: list[int]) -> list[int]:
        """What the draft model reads before its next guess (`window_feed`)."""
        feed, self.context_start = window_feed(self.state, self.readable(context_ids), self.context_start,
                                               self.context_tokens)
        return feed

    def _pick(self, logits: torch.Tensor, step: int, params: SamplingParams, generator, token_ids: list[int],
              rows: list[torch.Tensor]) -> bool:
        """Draft token `step` from the draft's logits [1, V_draft] into token_ids (and its distribution into rows,
        when sampling); False when the draft stops here."""
        if self.min_confidence and step > 0 and float(logits[0].softmax(-1).max()) < self.min_confidence:
            return False  # an unsure draft is likely rejected; a shorter draft saves draft steps (still exact)
        if params.greedy:
            index = int(logits[0].argmax())
        else:
            probs = processed_probs(logits, params)  # [1, V_draft]; accept_rejection aligns widths
            index = int(sample(probs, generator))
            rows.append(probs[0])
        token_ids.append(index if self.vocab is None else self.vocab.target_id(index))
        return True

    def _draft(self, token_ids: list[int], rows: list[torch.Tensor]) -> Draft:
        draft_probs = torch.stack(rows) if rows else None  # [k, V_draft]
        if draft_probs is not None and self.vocab is not None:
            draft_probs = self.vocab.spread(draft_probs)  # [k, V]: q is 0 outside the rows drafted from
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs)

    def batch_key(self) -> object | None:
        """Requests drafting with one native draft model step together (`propose_batch`); not a subclass that
        proposes otherwise (propose_batch gives what ModelDrafter.propose would)."""
        own = type(self).propose is ModelDrafter.propose
        return id(self.draft) if own and isinstance(self.state, NativeState) else None

    @classmethod
    def propose_batch(cls, drafters, contexts, ks, params, generators) -> list[Draft]:
        """Each step of every request's draft in one pass of the draft model (`NativeState.forward_many`: the
        weights read once for all; each request's logits, its own head rows included, bit for bit those of its own
        step), so each request gets the draft its `propose` would give. A catch-up longer than one kernel pass
        goes on its own first."""
        n = len(drafters)
        feeds = [d.to_feed(c) if k else []
                 for d, c, k in zip(drafters, contexts, ks)]
        logits: list[torch.Tensor | None] = [None] * n  # [1, V_draft] each
        together = [i for i in range(n) if ks[i] and len(feeds[i]) <= MAX_KERNEL_ROWS]
        for i in range(n):
            if ks[i] and i not in together:
                logits[i] = drafters[i].state.forward(feeds[i], 1)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
        step_ids = [feeds[i] for i in together]
        for step in range(max(ks, default=0)):
            if together:
                for i, out in zip(together, NativeState.forward_many([drafters[i].state for i in together],
                                                                     step_ids, [1] * len(together))):
                    logits[i] = out
            drafting = [i for i in range(n) if logits[i] is not None
                        and drafters[i]._pick(logits[i], step, params[i], generators[i], token_ids[i], rows[i])]
            # the next step feeds those still drafting (a request that stopped, its k reached or unsure, steps no more)
            together = [i for i in drafting if step + 1 < ks[i]]
            if not together:
                break
            step_ids = [token_ids[i][-1:] for i in together]
            logits = [None] * n
        return [d._draft(ids, r) for d, ids, r in zip(drafters, token_ids, rows)]

    def on_accept(self, context_ids: list[int], features=None) -> None:
        # drop rejected draft tokens; the new token is fed at the next propose
        self.state.sync(self.readable(context_ids[self.context_start:]))


def window_start(prompt_ids: list[int], context_tokens: int) -> int:
    """The context index a draft model's cache position 0 holds: it reads the prompt's last `context_tokens` (0: all
    of it). Nothing is fed at `begin`: the first proposal feeds the window with the pending token in one pass (the
    0.5B's 16 tokens at once 47-54 ms against 68-76 as 15 then 1, Xeon with AMX, 2026-12-06)."""
    return max(0, len(prompt_ids) - context_tokens) if context_tokens else 0


def window_feed(state, context_ids: list[int], context_start: int, most: int,
                dry_run: bool = False) -> tuple[list[int], int]:
    """(the ids the draft model's `state` reads before its next guess, the context index its position 0 then holds).
    It reads what it has not seen since `context_start`, its last token at least; past `most` tokens (0: no limit),
    which happens after a rest while the target ran plain passes or copies, it starts over on the context's last
    `most`, which bounds the catch-up at the cost of the context before them (the 0.5B reading 16 tokens costs
    1.0-1.2 one-token target passes, 4 tokens 0.40-0.45, 1 token 0.28-0.31: Zen 4, 2026-12-07; docs/performance.md).
    dry_run: the same answer, the state left as it is."""
    unseen = context_ids[context_start:]
    if dry_run:  # as `sync_for_next`: what the cache lacks, the last id at least
        feed = unseen[min(state.common_prefix(unseen), len(unseen) - 1):] if unseen else []
    else:
        feed = state.sync_for_next(unseen) if unseen else []
    if not feed or (most and len(feed) > most):  # (none: the context went back before the window's start)
        if not dry_run:
            state.truncate(0)
        context_start = max(len(context_ids) - most, 0) if most else 0
        feed = context_ids[context_start:]
    return feed, context_start


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
    if (isinstance(draft_tokenizer, FastTokenizer) and isinstance(target_tokenizer, FastTokenizer)
            and draft_tokenizer.backend is target_tokenizer.backend):  # one vocabulary (byte-identical files)
        return (len(draft_tokenizer), len(target_tokenizer)), 0
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    draft_in_target = all(target_vocab.get(tok) == idx for tok, idx in draft_vocab.items())
    target_in_draft = all(draft_vocab.get(tok) == idx for tok, idx in target_vocab.items())
    differing = 0 if draft_in_target or target_in_draft else sum(
        target_vocab.get(tok) != idx for tok, idx in draft_vocab.items())
    return (len(draft_vocab), len(target_vocab)), differing
