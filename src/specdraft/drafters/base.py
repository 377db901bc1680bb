"""The protocol every drafter follows; the engine knows nothing else about drafters."""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import SamplingParams
from ..types import Draft


class Drafter(Protocol):
    """Optional member: `feature_layers: tuple[int, ...]`, the target layers whose hidden states the drafter
    reads (indexing of Hugging Face's `output_hidden_states`); absent or () for drafters that read none.
    `features` below is then None; otherwise float32 [n, len(feature_layers), D], one row per target position
    the call reports, in sequence order. Optional member `draft_bytes: int`, the weight bytes one draft token
    reads (absent: 0, a free draft like prompt lookup); gamma auto (draft_length.py) weighs draft lengths by it.
    A drafter with several sources (lookup first: a copy, or the wrapped drafter) may have `next_source(context_ids)
    -> str | None`, naming the source of its next proposal from the context alone (None: the default one), and
    `source_bytes: dict[str, int]`, the weight bytes of a draft token of the named sources; gamma auto then keeps
    each source's acceptance and cost apart. Optional `use_target_state(state)`: called with the target's
    SequenceState of each request before the target's prefill (so it is still empty: read it from `begin` and
    `on_accept` on), and with None when the request ends; a drafter whose first layers are the target's (S2D
    exits on the target itself) reads the K/V the target cached rather than computing them again. It must not
    change the target's state. A pass with nothing to draft (gamma auto found that no draft pays, or one token
    is left) does not call `propose`: the next proposal catches up on the context."""

    name: str

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        """A new sequence starts: prefill whatever state the drafter keeps. features: the target's taps of
        prompt_ids[:-1] (the positions the target has cached; the last prompt token is pending)."""

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        """Propose up to k tokens continuing context_ids (prompt + everything emitted so far)."""

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        """The target kept some tokens; context_ids is the new full sequence. Roll back what was rejected.
        features: the taps of the positions this pass added to the target's cache (the previously pending
        token and the accepted draft tokens: context_ids[-n - 1:-1] for n rows)."""


class NoDrafter:
    """Plain autoregressive decoding: the loop with an empty draft."""

    name = "ar"

    def begin(self, prompt_ids: list[int], features=None) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        return Draft.empty()

    def on_accept(self, context_ids: list[int], features=None) -> None:
        pass
