"""The protocol every drafter follows; the engine knows nothing else about drafters."""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import SamplingParams
from ..types import Draft


class Drafter(Protocol):
    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """A new sequence starts: prefill whatever state the drafter keeps."""

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        """Propose up to k tokens continuing context_ids (prompt + everything emitted so far)."""

    def on_accept(self, context_ids: list[int]) -> None:
        """The target kept some tokens; context_ids is the new full sequence. Roll back what was rejected."""


class NoDrafter:
    """Plain autoregressive decoding: the loop with an empty draft."""

    name = "ar"

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        return Draft(torch.empty(0, dtype=torch.long))

    def on_accept(self, context_ids: list[int]) -> None:
        pass
