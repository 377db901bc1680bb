"""A reduced draft vocabulary: the draft scores only some rows of its LM head.

A draft's LM head is a large part of its step (the 0.5B's 151,936 x 896 head is 30 % of its bytes; for an early
exit of a sorted draft it is most of them). Drafting from a subset of the vocabulary reads only those rows.
The acceptance rule stays exact: the draft samples from the distribution over the subset, and that distribution,
spread over the full vocabulary with zeros elsewhere, is the q the rule uses. Greedy decoding stays token-identical
to the target; a target token outside the subset can only be rejected, never drafted.

Which rows: the `size` lowest ids, which in byte-level BPE vocabularies (Qwen2, Llama 3, GPT-2) are the earliest
merges, i.e. the most frequent pieces of the tokenizer's training text (measured on the packaged Qwen tokenizer:
the lowest 32,768 ids cover the target's benchmark outputs as well as the 32,768 most frequent ids of our
pinned-package corpus, 92 % both; docs/s2d.md), plus the tokenizer's special and added tokens (end of turn),
plus every token of the request's prompt (names and numbers the answer copies from it, the long tail that the
fixed rows miss). The fixed rows are copied once; a request gathers only its extra rows.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import SpecdraftError
from ..models.native.gguf_weights import ROW_GROUP, QuantWeight
from .base import Drafter

AUTO_ROWS = 32768  # draft_vocab None (auto): this many rows where the native head has more


def resolve_rows(requested: int | None, native) -> int:
    """The rows a drafter scores: `requested` as given (0 = all), or for None (auto) AUTO_ROWS when the draft
    runs on the native backend (`native` not None) with a larger vocabulary, else all (0)."""
    if requested is not None:
        return requested
    return AUTO_ROWS if native is not None and native.lm_head.shape[0] > AUTO_ROWS else 0


ROOM = 256  # rows the buffer keeps free for a request's prompt tokens past the fixed rows
COPY_ROWS = 2048  # head rows copied into the buffer at a time


class SplitRows:
    """A quantized head's scored rows in two parts, scored as one matrix [fixed + extra, D]: the fixed rows
    repacked in groups of 8 (`QuantWeight.interleave`), then a request's extra rows in the file's layout. Row by
    row, a one-token product of the 0.5B's 32,768 Q8_0 rows streamed at 15 GB/s, half what the repacked kernels
    read (Zen 4, 2026-12-07: 2.1 ms of a 12-14 ms draft step); the extra rows are few."""

    def __init__(self, fixed: QuantWeight, extra: QuantWeight):
        self.fixed = fixed  # [size, D]
        self.extra = extra  # [n_extra, D], n_extra >= 0

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.fixed) + len(self.extra), self.fixed.cols

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.fixed.nbytes + self.extra.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, D] float32 -> [T, fixed + extra] float32; each part through the batch-invariant kernels."""
        scores = self.fixed.linear(x, None)  # [T, size]
        if len(self.extra):
            scores = torch.cat([scores, self.extra.linear(x, None)], dim=1)  # [T, size + n_extra]
        return scores if bias is None else scores + bias

    def dequantize(self) -> torch.Tensor:
        """float32 [fixed + extra, D], the rows in order."""
        return torch.cat([self.fixed.dequantize(), self.extra.dequantize()])


class FixedRows:
    """The first `size` rows of a quantized head as `SplitRows` scores them: repacked in groups of 8 where the format
    allows (a view of a head already repacked, for whole groups; else repacked from the file's view, no temporary
    beside it, the last group padded), else the file's rows as they are. Kept with the head they came from, whose id
    keys `shared_fixed_rows`."""

    def __init__(self, head: QuantWeight, size: int):
        self.head = head
        if head.interleaved and size % ROW_GROUP == 0:
            self.rows = QuantWeight(head.blocks[: size // ROW_GROUP], head.qtype, head.cols, interleaved=True)
        else:
            self.rows = head[:size].interleave(pad=True)  # [size, D]


# (id of a head, rows) -> its FixedRows, while a draft vocabulary holds it: a server keeps a drafter per request in
# flight, and each would otherwise hold its own copy (the 0.5B's 32,768 rows: 30 MB)
_fixed_rows: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_fixed_rows(head: QuantWeight, size: int) -> FixedRows:
    found = _fixed_rows.get((id(head), size))
    if found is None or found.head is not head:
        found = _fixed_rows[(id(head), size)] = FixedRows(head, size)
    return found


class DraftVocab:
    """ids [V_draft] int64: the target ids the draft scores, ascending; weight [V_draft, D]: their head rows (for a
    quantized head, a `SplitRows`)."""

    def __init__(self, lm_head: torch.Tensor | QuantWeight, size: int, always: list[int] | tuple[int, ...] = ()):
        if size < 1:
            raise ValueError(f"a draft vocabulary needs at least one row, got {size}")
        self.lm_head = lm_head  # [V, D]: the draft's full head (its dtype is kept)
        self.full_size = lm_head.shape[0]
        self.size = min(size, self.full_size)
        self.always = sorted({i for i in always if 0 <= i < self.full_size})
        self.always_extra = [i for i in self.always if i >= self.size]  # kept rows past the fixed ones
        # the fixed rows are copied once into a buffer with room after them; a request writes only its extra rows
        # there (gathering all rows again took 33 ms a request for the 0.5B's 32,768 rows). A quantized head keeps
        # its fixed rows apart, repacked (`SplitRows`), and the buffer holds the extra rows alone.
        self._shared = shared_fixed_rows(lm_head, self.size) if isinstance(lm_head, QuantWeight) else None
        self._rows = lm_head.new_empty(self._start + len(self.always_extra) + ROOM, lm_head.shape[1])
        if self._shared is None:  # a slice at a time: no temporary of all the rows beside the buffer
            for start in range(0, self.size, COPY_ROWS):
                end = min(start + COPY_ROWS, self.size)
                self._rows[start:end] = lm_head[start:end]
        self.ids = torch.empty(0, dtype=torch.long)
        self.weight = lm_head[:0]
        self.for_prompt([])

    @property
    def fixed(self) -> QuantWeight | None:
        """[size, D]: a quantized head's fixed rows (`FixedRows`); None for a float head, whose buffer holds them."""
        return self._shared.rows if self._shared is not None else None

    @property
    def _start(self) -> int:
        """Where a request's extra rows go in the buffer: after the fixed rows, unless they are kept apart."""
        return 0 if self._shared is not None else self.size

    @classmethod
    def for_model(cls, lm_head: torch.Tensor | QuantWeight, tokenizer, size: int) -> DraftVocab:
        """The tokenizer's special and added tokens always stay in (an answer must be able to end)."""
        always = set(getattr(tokenizer, "all_special_ids", []) or [])
        always.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        return cls(lm_head, size, tuple(always))

    def for_prompt(self, prompt_ids: list[int]) -> None:
        """Rows for one request: the fixed ones and the prompt's tokens."""
        extra = {i for i in prompt_ids if self.size <= i < self.full_size}
        extra.update(self.always_extra)
        extra_ids = torch.tensor(sorted(extra), dtype=torch.long)  # [n_extra]
        end = self._start + len(extra_ids)  # the buffer's rows in use
        if end > self._rows.shape[0]:  # a prompt with more new tokens than the room: grow, keeping the fixed rows
            with torch.inference_mode(False):  # a normal tensor, so later requests may write it in any mode
                grown = self._rows.new_empty(end + ROOM, self._rows.shape[1])
                grown[: self._start] = self._rows[: self._start]
            self._rows = grown
        if len(extra_ids):
            self._rows[self._start: end] = self.lm_head[extra_ids]
        self.ids = torch.cat([torch.arange(self.size), extra_ids])
        # [V_draft, D]: valid until the next request's for_prompt rewrites the extra rows
        self.weight = SplitRows(self.fixed, self._rows[:end]) if self._shared is not None else self._rows[:end]

    def target_id(self, draft_index: int) -> int:
        return int(self.ids[draft_index])

    def spread(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[k, V_draft] values over the subset -> [k, V] over the full vocabulary, `fill` elsewhere (0 for
        probabilities, -inf for log-scores)."""
        full = values.new_full((values.shape[0], self.full_size), fill)
        full[:, self.ids] = values
        return full


class HasDraftVocab(Drafter):
    """Base of the drafters that may score a reduced vocabulary (`self.vocab`, None for all rows)."""

    vocab: DraftVocab | None = None

    backend: str = ""  # the draft model's backend
    draft_vocab_size: int = 0  # the draft model's token ids (`choose_rows`): ids from there on are the target's alone

    @property
    def vocab_rows(self) -> int:
        """Rows of the head scored per step before the prompt's tokens (0: all)."""
        return self.vocab.size if self.vocab is not None else 0

    def statistics(self) -> dict[str, object]:
        return {"draft_backend": self.backend, "draft_vocab": self.vocab_rows}

    def choose_rows(self, draft, rows: int | None) -> None:
        """Score `rows` of the draft model's head (0: all, None: auto, resolve_rows): sets self.vocab, or refuses a
        draft on the transformers backend, which has no native head to take rows of."""
        self.draft_vocab_size = draft.vocab_size
        rows = resolve_rows(rows, draft.native)
        if rows and draft.native is None:
            raise SpecdraftError(f"a reduced draft vocabulary scores rows of the native backend's LM head; "
                                 f"{draft.name!r} is on transformers ({draft.backend_note}); drop --draft-vocab")
        self.vocab = DraftVocab.for_model(draft.native.lm_head, draft.tokenizer, rows) if rows else None

    def scored_head_bytes(self, native) -> int:
        """Bytes of the head rows one step scores (native: the draft's NativeLlama): the reduced rows, or all."""
        head = native.lm_head  # [V, D], in its stored format
        return (self.vocab.size if self.vocab is not None else head.shape[0]) * head[0].nbytes

    def score_rows(self, draft, rows: int | None) -> None:
        """choose_rows, and self.draft_bytes: the weight bytes one draft step reads (gamma auto weighs draft
        lengths by it), the whole draft model less the head rows a reduced vocabulary skips."""
        self.choose_rows(draft, rows)
        self.draft_bytes = draft.weight_bytes
        if self.vocab is not None:  # the head rows it skips are not read
            head = draft.native.lm_head  # [V, D]
            self.draft_bytes += self.scored_head_bytes(draft.native) - head.shape[0] * head[0].nbytes

    def readable(self, ids: list[int]) -> list[int]:
        """`ids` as the draft model can read them: a token of the target's that its vocabulary lacks (an id past
        its embedding's rows: a larger vocabulary extending the draft's) becomes the draft's id 0. Only the draft's
        view of the context changes there, so only how good its drafts are: the target verifies every one."""
        if not self.draft_vocab_size or not ids or max(ids) < self.draft_vocab_size:
            return ids
        return [token if token < self.draft_vocab_size else 0 for token in ids]

    def rows_for_prompt(self, state, prompt_ids: list[int]) -> None:
        """A new request: the rows of its prompt join, and the draft model's state scores them (its logits are then
        [n, V_draft]). Nothing with all rows."""
        if self.vocab is not None:
            self.vocab.for_prompt(self.readable(prompt_ids))
            state.lm_head = self.vocab.weight
