"""The contract every drafter follows; the engine knows nothing else about drafters."""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..types import Acceptance, Draft


class Drafter:
    """A drafter proposes tokens for the target to verify. Subclasses implement `begin`, `propose` and `on_accept`
    and set `name`; the other members are declared here with the defaults of a drafter that does not use them,
    so the engine and wrappers (lookup first) read them directly.

    A pass with nothing to draft (gamma auto found that no draft pays, or one token is left) does not call
    `propose`: the next proposal catches up on the context."""

    name: str = ""
    # target layers whose hidden states the drafter reads (indexing of Hugging Face's `output_hidden_states`);
    # () for none. With some, the `features` passed to `begin` and `on_accept` are float32
    # [n, len(feature_layers), D], one row per target position the call reports, in sequence order (else None).
    feature_layers: tuple[int, ...] = ()
    # weight bytes one draft token reads (0: a free draft, like prompt lookup); gamma auto (draft_length.py)
    # weighs draft lengths by it. May be a property that follows the request (the sorted draft's exits).
    draft_bytes: float = 0
    # whether gamma auto prices its draft token by a timed step (models/verify_curve.py `draft_price`) rather than
    # by its weight bytes alone: a small model's step carries more fixed work per byte than the target's (24 layers
    # of small matrices), 1.6x per byte for the 0.5B draft against the 1.5B target (Zen 3, 2026-12-03)
    timed_price: bool = False
    # the most positions a sequence may reach for this drafter (its model's context, where shorter than the
    # target's: a long-RoPE model's native context); None: no limit of its own
    max_positions: int | None = None
    # the node budget of a tree drafter (its drafts are trees of at most this many nodes); None for a chain drafter
    budget: int | None = None
    # whether it keeps one sequence's state between calls (a draft model's cache, an EAGLE head's): requests
    # decoded together (Engine.generate_many) then need one instance each
    keeps_sequence_state: bool = True
    # whether `begin` and `on_accept` need only token ids and a proposal catches up on any context it has not
    # seen: the loop then begins it at its first proposal, so a request that never drafts (gamma auto in a busy
    # server's shared passes) never pays the drafter's own prefill
    catches_up: bool = False

    @property
    def source_bytes(self) -> dict[str, int]:
        """A drafter with several sources (lookup first: a copy, or the wrapped drafter): the weight bytes of a
        draft token of each named source besides the default one; gamma auto keeps their acceptance and cost
        apart. Empty for a drafter with one source."""
        return {}

    def statistics(self) -> dict[str, object]:
        """What the statistics say of this drafter's setup (SpecStats.drafter, beside its tally's counters): e.g. the
        draft model's backend ("draft_backend"), the head rows it scores per step ("draft_vocab", 0: all), lookup
        first's shortest n-gram ("lookup_first"). The default: nothing."""
        return {}

    def new_tally(self) -> DraftTally:
        """The counters one request keeps of this drafter's drafts (the loop feeds it every pass)."""
        return DraftTally()

    def batch_key(self) -> object | None:
        """Drafters of one class and one key may draft for several requests in one call (`propose_batch`), e.g.
        one draft model whose steps for all of them run as one pass. None: this drafter proposes alone."""
        return None

    @classmethod
    def propose_batch(cls, drafters: list[Drafter], contexts: list[list[int]], ks: list[int],
                      params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Draft]:
        """The proposals of several requests (drafters of this class and one `batch_key`), each the draft its own
        `propose` would give (the same tokens: each samples with its own generator in the same order). The
        default: one after another."""
        return [drafter.propose(context, k, p, generator)
                for drafter, context, k, p, generator in zip(drafters, contexts, ks, params, generators)]

    def catch_up_tokens(self, prompt_len: int, context_len: int) -> int:
        """A drafter that catches up, begun only now that the context is context_len tokens long: the tokens it
        reads before its first draft (the loop does not begin it for fewer tokens left than that). The default:
        the whole context."""
        return context_len

    def reads_before_guess(self, context_ids: list[int], prompt_len: int, begun: bool) -> int:
        """The tokens it would read before its next guess: its catch-up when it has not begun (`catch_up_tokens`),
        none after that (a draft model: what it has not seen yet). gamma auto prices a read of several in a pass
        shared with other requests, which all wait for it."""
        return 0 if begun else self.catch_up_tokens(prompt_len, len(context_ids))

    def next_source(self, context_ids: list[int]) -> str | None:
        """The source of the next proposal, from the context alone (None: the default one)."""
        return None

    def use_target_state(self, target_state) -> None:
        """Called with the target's SequenceState of each request before the target's prefill (so it is still
        empty: read it from `begin` and `on_accept` on), and with None when the request ends. A drafter whose
        first layers are the target's (S2D exits on the target itself) reads the K/V the target cached rather
        than computing them again. It must not change the target's state. The default ignores it."""

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        """A new sequence starts: prefill whatever state the drafter keeps. features: the target's taps of
        prompt_ids[:-1] (the positions the target has cached; the last prompt token is pending)."""
        raise NotImplementedError

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        """Propose up to k tokens continuing context_ids (prompt + everything emitted so far)."""
        raise NotImplementedError

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        """The target kept some tokens; context_ids is the new full sequence. Roll back what was rejected.
        features: the taps of the positions this pass added to the target's cache (the previously pending
        token and the accepted draft tokens: context_ids[-n - 1:-1] for n rows)."""
        raise NotImplementedError


class DraftTally:
    """What one request counts of its drafter's drafts, beside the loop's own counters (SpecStats): the loop hands
    it each pass's draft and verdict (`record`), and `to_dict` goes into the statistics under "drafter". This one
    counts nothing."""

    def record(self, draft: Draft, result: Acceptance) -> None:
        pass

    def to_dict(self) -> dict[str, object]:
        return {}


class LabelTally(DraftTally):
    """For drafters whose tokens carry labels (Draft.labels: a sorted exit, a lookup-first copy): the tokens each
    label drafted ("drafted_by") and had accepted ("accepted_by"). A tree counts every node it drafted."""

    def __init__(self) -> None:
        self.drafted_by: dict[str, int] = {}
        self.accepted_by: dict[str, int] = {}

    def record(self, draft: Draft, result: Acceptance) -> None:
        labels = draft.labels or []
        for label in labels:
            self.drafted_by[label] = self.drafted_by.get(label, 0) + 1
        for node in result.accepted_nodes if labels else ():
            self.accepted_by[labels[node]] = self.accepted_by.get(labels[node], 0) + 1

    def to_dict(self) -> dict[str, object]:
        return {"drafted_by": dict(self.drafted_by), "accepted_by": dict(self.accepted_by)}


class Tallies(DraftTally):
    """Several tallies fed the same passes (a wrapper's and the wrapped drafter's); their dicts merged."""

    def __init__(self, *tallies: DraftTally) -> None:
        self.tallies = tallies

    def record(self, draft: Draft, result: Acceptance) -> None:
        for tally in self.tallies:
            tally.record(draft, result)

    def to_dict(self) -> dict[str, object]:
        return {key: value for tally in self.tallies for key, value in tally.to_dict().items()}


class NoDrafter(Drafter):
    """Plain autoregressive decoding: the loop with an empty draft."""

    name = "ar"
    keeps_sequence_state = False
    catches_up = True

    def begin(self, prompt_ids: list[int], features=None) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        return Draft.empty()

    def on_accept(self, context_ids: list[int], features=None) -> None:
        pass
