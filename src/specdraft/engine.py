"""The token-scale loop: propose -> verify -> accept -> rollback. Autoregressive decoding is the same loop
with an empty draft.

Cache convention: the target's cache holds every token of the sequence except the last one (the *pending*
token, emitted but not yet run through the target). A pass feeds [pending, d_1 .. d_k] and gets k + 1 rows of
logits: row i scores the position after d_i, row 0 the position after the pending token. A tree draft is fed
the same way, flattened, with a tree attention mask and positions start + depth (SequenceState.verify); the
accepted path then moves to consecutive cache positions (SequenceState.keep_verified).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .acceptance import accept_draft, accept_rejection, accept_tree_rejection
from .config import SamplingParams, SpecConfig
from .draft_length import AdaptiveLength, DraftLength, FixedLength, PassLoad, VerifyCurve
from .drafters.base import Drafter, NoDrafter
from .errors import SpecdraftError
from .models.adapter import LoadedModel, NativeState
from .models.native.llama import MAX_KERNEL_ROWS
from .prefix_cache import PrefixCache
from .types import DRAFTER_SOURCE, Acceptance, Draft, GenerationResult, SpecStats


# (draft_ids [k], draft_probs [k, V] | None, target_probs [k + 1, V], generator) -> Acceptance
SamplingRule = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None], Acceptance]
# (draft_ids [k], parents [k], draft_probs [k, V] | None, target_probs [k + 1, V], generator) -> Acceptance
TreeSamplingRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
                            Acceptance]


@dataclass
class StreamChunk:
    """Text that became final during one target pass (possibly empty), and the tokens behind it."""

    text: str
    token_ids: list[int]


class DecodeLoop:
    """One request's token-scale loop, a target pass at a time: `propose` (the drafter drafts), the target scores
    the pending token and the draft (the caller runs that pass: alone, `Generation.__iter__`; with other requests
    in one pass, `verify_together`, as `Engine.generate_many` and the server do), `accept` (keep or resample, roll
    back, tell the drafter) returns the tokens the pass emits. `draft_length` says how many tokens to draft in each
    pass (a fixed gamma, or chosen per pass: draft_length.py). The prompt is prefilled at construction, or
    (prefill_by_chunks) by the caller's calls to `prefill`. With a `prefix_cache`, prefill starts after the longest
    prefix of the prompt that an earlier sequence of the target cached (bit for bit what this one would compute),
    and leaves its own for later ones.

    `sampling_rule` / `tree_sampling_rule` decide acceptance of chain / tree drafts when sampling (greedy always
    keeps the longest path matching the target's argmax); tests swap in deliberately wrong rules as negative
    controls."""

    def __init__(self, target: LoadedModel, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                 draft_length: DraftLength, generator: torch.Generator | None, stats: SpecStats,
                 sampling_rule: SamplingRule = accept_rejection,
                 tree_sampling_rule: TreeSamplingRule = accept_tree_rejection, prefill_by_chunks: bool = False,
                 prefix_cache: PrefixCache | None = None):
        self.drafter, self.params, self.draft_length, self.generator, self.stats = (drafter, params, draft_length,
                                                                                    generator, stats)
        self.sampling_rule, self.tree_sampling_rule = sampling_rule, tree_sampling_rule
        started = time.perf_counter()
        # a drafter that reads the target's hidden states (EAGLE) names the layers; every pass then keeps them
        self.state = target.new_state(capacity=len(prompt_ids) + params.max_new_tokens + draft_length.most + 1,
                                      feature_layers=drafter.feature_layers)
        # a drafter whose layers are the target's own (self-speculation) takes their K/V from the target's cache
        drafter.use_target_state(self.state)
        stats.time_prefill_s += time.perf_counter() - started
        self.context = list(prompt_ids)
        self.budget = params.max_new_tokens
        self.draft, self.source = Draft.empty(), None
        self.tally = drafter.new_tally()  # the drafter's own counters (stats.drafter)
        self._started = self._proposed_at = self.verify_started = 0.0  # verify_started: when its pass began
        self.prompt_len = len(prompt_ids)
        self.drafter_begun = False
        self._prefilled = 0  # prompt tokens in the target's cache (all but the last: it is the first pending token)
        self.prefix_cache = prefix_cache
        self._restored: int | None = None  # prompt tokens the prefix cache gave (None: not asked yet)
        self._prefill_features: list[torch.Tensor] = []  # [chunk, n_taps, D] per chunk, for a drafter that taps
        self.prefilling = True
        if not prefill_by_chunks:
            self.prefill()

    def prefill(self, most: int | None = None) -> bool:
        """Run the next `most` prompt tokens (None: all that are left) through the target; when the prompt is in,
        the drafter begins. Returns whether prefill is done. A server prefills a long prompt in chunks between
        the passes of running requests, or inside them (`prefill_chunk`, `prefill_ran`); a chunk's rows come out
        as they would in one pass (the kernels are batch-invariant) except for float32 weights, whose passes over
        more than 32 tokens use torch's matmul."""
        chunk = self.prefill_chunk(most)  # (its prefix cache's restore counted there)
        started = time.perf_counter()
        if chunk:
            self.state.forward(chunk, 1)
        return self.prefill_ran(len(chunk), time.perf_counter() - started)

    def prefill_chunk(self, most: int | None = None) -> list[int]:
        """The prompt tokens the next prefill pass runs: at most `most` (None: all that are left) after those in
        the cache; empty when none are left. The first call restores the longest cached prefix of the prompt."""
        if self._restored is None:  # asked at the first chunk: an earlier chunk of another request may have stored it
            started = time.perf_counter()
            to_cache = len(self.context) - 1
            self._restored = (self.prefix_cache.restore(self.state, self.context[:to_cache])
                              if self.prefix_cache is not None and to_cache else 0)
            self._prefilled = self.stats.cached_prompt_tokens = self._restored
            self.stats.time_prefill_s += time.perf_counter() - started
        end = len(self.context) - 1 if most is None else min(len(self.context) - 1, self._prefilled + most)
        return self.context[self._prefilled: end]

    def prefill_ran(self, n: int, seconds: float) -> bool:
        """A pass ran the first n tokens of `prefill_chunk` (this loop's own, or a pass shared with others:
        `verify_together`), in `seconds`: counted, and when the prompt is in, it is stored in the prefix cache and
        the drafter begins. Returns whether prefill is done."""
        to_cache = len(self.context) - 1
        if n:
            if self.state.features is not None:
                self._prefill_features.append(self.state.features)
            self._prefilled += n
        self.stats.time_prefill_s += seconds
        if self._prefilled == to_cache:
            self.prefilling = False
            if self.prefix_cache is not None and to_cache > self._restored:
                self.prefix_cache.store(self.state, self.context[:to_cache])
            if not self.drafter.catches_up:  # else at its first proposal (`propose`)
                features = (None if not self._prefill_features else self._prefill_features[0]
                            if len(self._prefill_features) == 1 else torch.cat(self._prefill_features))
                self._begin_drafter(features)  # features: [n_prompt - 1, n_taps, D] or None
            self._prefill_features = []
        return not self.prefilling

    def _begin_drafter(self, features: torch.Tensor | None) -> None:
        """The drafter begins on the prompt (a drafter that reads it there, timed as prefill; a draft model reads its
        window with its first proposal)."""
        started = time.perf_counter()
        self.drafter.begin(self.context[: self.prompt_len], features)
        self.drafter_begun = True
        self.stats.time_prefill_s += time.perf_counter() - started

    @property
    def finished(self) -> bool:
        return self.budget <= 0

    @property
    def pending(self) -> int:
        """The last token: scored by the next target pass, before the draft."""
        return self.context[-1]

    def propose(self, load: PassLoad = PassLoad()) -> Draft:
        """The draft of the next pass (empty when none pays or one token is left). load: what other requests
        put into the same target pass (gamma auto drafts less in a fuller pass)."""
        to_draft = self.plan(load)
        return self.take_draft(self.drafter.propose(self.context, to_draft, self.params, self.generator)
                               if to_draft else Draft.empty())

    def plan(self, load: PassLoad = PassLoad()) -> int:
        """The first half of `propose`: how many tokens to draft (the drafter begun if it now drafts), for the
        caller to draft them (`propose_together` drafts for several requests at once) and hand the draft to
        `take_draft`."""
        self._started = time.perf_counter()
        # never draft past the token budget (the last token of a pass is the target's own)
        self.source = self.drafter.next_source(self.context)  # who drafts, when the drafter has several sources
        # what the drafter would first read, asked where gamma auto prices it: in a pass shared with others
        reads = (self.drafter.reads_before_guess(self.context, self.prompt_len, self.drafter_begun)
                 if load.requests else 1)
        to_draft = min(self.draft_length.next(self.source, len(self.context), load, reads), self.budget - 1)
        # nothing to draft: a plain pass; the drafter catches up on the context at its next proposal
        if to_draft and not self.drafter_begun:
            if (len(self.context) > self.prompt_len
                    and self.budget < self.drafter.catch_up_tokens(self.prompt_len, len(self.context))):
                # begun this late, it would first read what it has not seen: not for fewer tokens left than that
                to_draft = 0
            else:
                self._begin_drafter(None)
                self._started = time.perf_counter()  # its prefill is not draft time
        return to_draft

    def take_draft(self, draft: Draft) -> Draft:
        """The second half of `propose`: the draft the pass verifies."""
        self.draft = draft
        self._proposed_at = self.verify_started = time.perf_counter()
        return draft

    def load(self, k: int | None = None) -> PassLoad:
        """What this request puts into the coming pass (after `propose`; before it, with k planned tokens): its
        tokens, the one it emits at least, and its draft's cost."""
        k = self.draft.k if k is None else k
        return PassLoad(k + 1, 1, k * self.draft_length.token_cost(self.source))

    def accept(self, target_logits: torch.Tensor) -> list[int]:
        """target_logits [k + 1, V]: the pass over the pending token and the draft (`SequenceState.verify`). Returns
        the tokens the pass emits."""
        draft, stats, state = self.draft, self.stats, self.state
        # accept: greedy or sampling, chain or tree (a chain is a tree without branches)
        result: Acceptance = accept_draft(draft, target_logits, self.params, self.generator, self.sampling_rule,
                                          self.tree_sampling_rule)
        # rollback: keep the pending token and the accepted path (moved to consecutive positions in a tree); the
        # new last token becomes pending
        state.keep_verified(result.accepted_nodes)
        self.context.extend(result.tokens)
        # the taps of the pending token and the accepted drafts (keep_verified put a tree's path in order)
        kept_features = None if state.features is None else state.features[: result.n_accepted + 1]
        if self.drafter_begun:
            self.drafter.on_accept(self.context, kept_features)
        stats.time_draft_s += self._proposed_at - self._started
        stats.time_verify_s += time.perf_counter() - self.verify_started
        stats.record(draft.k, result.n_accepted, None if draft.parents is None else draft.depth)
        if draft.k and draft.parents is None:
            stats.record_steps(self.source or DRAFTER_SOURCE, draft.k, result.n_accepted)
        self.draft_length.observe(draft.k, result.n_accepted, self.source)
        self.tally.record(draft, result)
        stats.drafter.update(self.tally.to_dict())
        self.budget -= len(result.tokens)
        return result.tokens

    def close(self) -> None:
        """The request ended (or was abandoned): the drafter lets go of the target's cache."""
        self.drafter.use_target_state(None)


def shares_pass(loop: DecodeLoop, draft: Draft) -> bool:
    """Whether this request's pass can join others' (`NativeState.verify_many`): a chain of at most
    MAX_KERNEL_ROWS tokens on the native backend, without taps for a drafter that reads the target's features."""
    return (isinstance(loop.state, NativeState) and not loop.state.feature_layers and draft.parents is None
            and draft.k + 1 <= MAX_KERNEL_ROWS)


def prefill_rides(prefilling: DecodeLoop, chunk: list[int], loops: list[DecodeLoop], drafts: list[Draft]) -> bool:
    """Whether `chunk` of a prompt (`prefilling.prefill_chunk`) can ride in the pass that `verify_together` shares
    among these loops: one of them shares it, and the chunk's rows come out as its own pass would give them."""
    return bool(chunk) and isinstance(prefilling.state, NativeState) and any(
        shares_pass(loop, draft) and prefilling.state.rides_along(loop.state, len(chunk))
        for loop, draft in zip(loops, drafts))


def verify_together(loops: list[DecodeLoop], drafts: list[Draft], errors: dict[int, Exception] | None = None,
                    prefill: tuple[DecodeLoop, list[int]] | None = None) -> list[torch.Tensor | None]:
    """Each loop's target pass over its pending token and draft (logits [k + 1, V] each): those that can share
    one pass do (`NativeState.verify_many`: the weights are read once for all); a token tree, a drafter that reads
    the target's features, more than MAX_KERNEL_ROWS tokens or the transformers backend runs on its own.
    errors: where a pass of its own fails, its loop's index -> the exception, and None for its logits (without
    it, the exception propagates). prefill: a chunk of another request's prompt that rides in the shared pass
    (where `prefill_rides` says it can; the caller then calls the loop's `prefill_ran`)."""
    together = [i for i, (loop, draft) in enumerate(zip(loops, drafts)) if shares_pass(loop, draft)]
    logits: list[torch.Tensor | None] = [None] * len(loops)
    if len(together) > 1 or prefill is not None:
        rider = None if prefill is None else (prefill[0].state, prefill[1])
        rows = NativeState.verify_many([loops[i].state for i in together], [loops[i].pending for i in together],
                                       [drafts[i] for i in together], rider)
        for i, row in zip(together, rows):
            logits[i] = row
    for i, (loop, draft) in enumerate(zip(loops, drafts)):
        if logits[i] is None:
            try:
                # one target pass over the pending token and the k draft nodes (a tree: with a tree mask)
                logits[i] = loop.state.verify(loop.pending, draft)
            except Exception as exc:
                if errors is None:
                    raise
                errors[i] = exc
    return logits


def propose_together(loops: list[DecodeLoop], joining: int = 0, errors: dict[int, Exception] | None = None,
                     riding: int = 0) -> list[Draft]:
    """The drafts of one batched pass: each request drafts knowing what the others put into the pass (those
    before it: their drafts; those after it: their pending token). `joining`: requests still prefilling, counted
    as one token each (they join the next passes: a request alone for a pass or two while others prefill does not
    begin a draft model for them); `riding`: prompt tokens of a prefill chunk in the same pass. errors: where a
    drafter fails, its loop's index -> the exception, and an empty draft in its place (without it, the exception
    propagates).

    The lengths are planned first (each knowing the planned lengths before it), then the drafters draft: those
    of one class and `batch_key` in one call (`Drafter.propose_batch`: one draft model's steps for all its
    requests in one pass), the others one by one."""
    drafts: list[Draft] = [Draft.empty()] * len(loops)
    planned: list[int] = [0] * len(loops)
    load = PassLoad(tokens=len(loops) + joining + riding, requests=len(loops) + joining)

    def failed(i: int, exc: Exception) -> None:
        if errors is None:
            raise exc
        errors[i] = exc

    for i, loop in enumerate(loops):
        load = load - PassLoad(1, 1)  # this request's own pending token
        try:
            planned[i] = loop.plan(load)
        except Exception as exc:
            failed(i, exc)
        load = load + loop.load(planned[i])
    groups: dict[tuple, list[int]] = {}  # (drafter class, batch key) -> the loops it drafts for together
    for i, loop in enumerate(loops):
        key = loop.drafter.batch_key() if planned[i] else None
        groups.setdefault((type(loop.drafter), key) if key is not None else ("alone", i), []).append(i)
    for members in groups.values():
        batch = [loops[i] for i in members]
        started = time.perf_counter()
        for loop in batch:  # a request's draft time is its group's drafting, not the planning or other groups'
            loop._started = started
        try:
            if len(members) > 1:
                proposed = type(batch[0].drafter).propose_batch(
                    [loop.drafter for loop in batch], [loop.context for loop in batch], [planned[i] for i in members],
                    [loop.params for loop in batch], [loop.generator for loop in batch])
            else:
                proposed = [None]
        except Exception as exc:  # one request's drafter failed: each on its own below, to tell which (a sampled
            # request's generator has moved on, so its draft is another exact one than alone)
            logging.getLogger(__name__).warning("batched drafting failed (%s: %s); drafting one by one",
                                                type(exc).__name__, exc)
            proposed = [None] * len(members)
        for i, draft in zip(members, proposed):
            try:
                if draft is None:  # on its own (it syncs its drafter to the context first, whatever ran before)
                    draft = (loops[i].drafter.propose(loops[i].context, planned[i], loops[i].params,
                                                      loops[i].generator) if planned[i] else Draft.empty())
            except Exception as exc:
                failed(i, exc)
                draft = Draft.empty()
            drafts[i] = loops[i].take_draft(draft)
    verify_starts = time.perf_counter()
    for loop in loops:  # a request's verify time starts with the pass, not with its own proposal
        loop.verify_started = verify_starts
    return drafts


# the text generated so far -> whether the request ends there (`Engine.stream`'s stop_when)
StopRule = Callable[[str], bool]


class StopChecker:
    """Incremental detokenizer that holds text back while it could still be the start of a stop string.

    stop_when: a rule on the text so far; when it holds, the request ends with the shortest token prefix whose
    text satisfies it (the text is kept whole: the rule does not say where to cut), as if it were checked after
    every token."""

    def __init__(self, tokenizer, stop: tuple[str, ...], stop_when: StopRule | None = None):
        self.tokenizer = tokenizer
        self.stop = stop
        self.stop_when = stop_when
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.stopped = False

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return newly final text. Sets `stopped` when a stop string appeared (text cut before it) or
        the stop rule holds (tokens cut after the first that made it hold)."""
        checked = len(self.token_ids)  # prefixes up to here were checked by earlier pushes
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.emitted_chars - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text[: min(hits)])
        if self.stop_when is not None and new_ids and self.stop_when(text):
            self.token_ids, self.stopped = self.token_ids[: self._first_prefix(checked + 1, self.stop_when)], True
            return self._take(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        hold = max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)
        return self._take(text[: len(text) - hold])

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._take(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))

    def _take(self, final_text: str) -> str:
        chunk = final_text[self.emitted_chars:]
        self.emitted_chars = max(self.emitted_chars, len(final_text))
        return chunk

    def tokens_up_to_stop(self) -> list[int]:
        """The shortest token prefix whose text contains a stop string (tokens past it are dropped)."""
        if not self.stop:  # ended by the stop rule: `push` cut the tokens already
            return self.token_ids
        return self.token_ids[: self._first_prefix(1, lambda text: any(s in text for s in self.stop))]

    def _first_prefix(self, shortest: int, holds: StopRule) -> int:
        """The fewest tokens, from `shortest` on, whose text `holds` (all of them when none does)."""
        for n in range(shortest, len(self.token_ids) + 1):
            if holds(self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True)):
                return n
        return len(self.token_ids)


def check_text(text: str, what: str) -> None:
    """Refuse text that is not Unicode a tokenizer can take (a lone surrogate, e.g. from a JSON "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SpecdraftError(f"{what} is not valid Unicode: a lone surrogate at character {error.start}; "
                             "send UTF-8 text") from None


class Engine:
    """A target model, a drafter and a speculative configuration; `stream` and `generate` run the loop."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 sampling_rule: SamplingRule = accept_rejection,
                 tree_sampling_rule: TreeSamplingRule = accept_tree_rejection,
                 new_drafter: Callable[[], Drafter] | None = None, curve: VerifyCurve | None = None,
                 prefix_cache: PrefixCache | None = None, draft_price: float = 1.0):
        """new_drafter: builds another drafter like `drafter`, for requests decoded together (`generate_many`)
        when the drafter keeps one sequence's state (load_engine passes it). curve: the target's verify cost,
        which gamma auto needs (measured once per machine and cached: `verify_curve(target, spec.draft_len + 1)`,
        models/verify_curve.py; load_engine measures it); the engine itself measures nothing. draft_price: what a
        byte of a draft step costs against a byte of the target's, for gamma auto (`draft_price(target, drafter)`,
        measured and cached beside the curve; 1.0: by bytes alone). prefix_cache:
        prompts' K/V kept for later prompts that begin the same way (prefix_cache.py; engines of one target may
        share one); None: every prompt is prefilled whole."""
        self.target = target
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise SpecdraftError(f"an Engine's prefix_cache must be a specdraft PrefixCache, got "
                                 f"{type(prefix_cache).__name__}")
        self.prefix_cache = prefix_cache
        self.new_drafter = new_drafter
        target.prepare_full_head()
        self.sampling_rule = sampling_rule
        self.tree_sampling_rule = tree_sampling_rule
        if drafter is not None and not isinstance(drafter, Drafter):
            raise SpecdraftError(f"an Engine's drafter must be a specdraft Drafter (specdraft.drafters.base), got "
                                 f"{type(drafter).__name__}")
        self.drafter: Drafter = drafter or NoDrafter()
        self.spec = spec or SpecConfig(method="ar")
        if self.spec.draft_len == 0:
            self.drafter = NoDrafter()
        self._idle_drafters: list[Drafter] = [self.drafter]  # drafters no request holds (acquire_drafter)
        self._drafters_owned = 1  # built for this engine: held by requests or idle
        self._drafters_lock = threading.Lock()
        self.curve: VerifyCurve | None = None  # gamma auto: T(n) / T(1), n = 1 .. draft_len + 1, by context
        self.target_bytes = 1  # gamma auto: a draft token costs its weight bytes over these (the target's) ...
        self.draft_price = float(draft_price)  # ... times this, a draft byte's measured price
        self.source_costs: dict[str, float] = {}  # gamma auto: a draft token's cost, as a fraction of a one-token
        # target pass, for the drafter's other sources
        if self.spec.adaptive_gamma:
            if curve is None:
                raise SpecdraftError("gamma auto chooses each pass's draft length from the target's verify cost: pass "
                                     "curve=verify_curve(target, spec.draft_len + 1) (specdraft.models.verify_curve; "
                                     "measured once per machine, about 30 s, then cached), build the engine with "
                                     "load_engine, which does that, or give a fixed gamma")
            if len(curve.short) < self.spec.draft_len + 1:
                raise SpecdraftError(f"the verify curve covers passes of up to {len(curve.short)} tokens; gamma auto "
                                     f"drafts up to {self.spec.draft_len}: measure it for {self.spec.draft_len + 1}")
            self.curve = curve
            # decoding is bound by weight reads on a CPU: a draft token costs its weight bytes over the target's
            self.target_bytes = target_bytes = target.weight_bytes
            self.source_costs = {source: n / target_bytes
                                 for source, n in self.drafter.source_bytes.items()}

    def acquire_drafter(self) -> Drafter:
        """A drafter for one more request in flight: the engine's own while no other request holds it, or one
        that keeps no per-sequence state (prompt lookup: every request may share it), else a new one built by
        `new_drafter`. Give it back with `release_drafter`."""
        if not self.drafter.keeps_sequence_state:
            return self.drafter
        with self._drafters_lock:
            if self._idle_drafters:
                return self._idle_drafters.pop()
        return self._build_drafter()

    def drafters_missing(self, count: int) -> int:
        """How many drafters `ensure_drafters(count)` would build."""
        if not self.drafter.keeps_sequence_state or self.new_drafter is None:
            return 0
        with self._drafters_lock:
            return max(count - self._drafters_owned, 0)

    def ensure_drafters(self, count: int) -> None:
        """Build drafters until the engine owns `count` (held or idle), so that that many requests in flight find
        one without waiting for a build (a server builds them while preparing a request, between the passes of
        the others). The pool never shrinks: `count` bounds it."""
        while self.drafters_missing(count):
            self.release_drafter(self._build_drafter())

    def _build_drafter(self) -> Drafter:
        if self.new_drafter is None:
            raise SpecdraftError(f"drafter {self.drafter.name!r} keeps one sequence's state: build the engine with "
                                 "load_engine (or pass new_drafter=) to decode several requests at once")
        drafter = self.new_drafter()
        with self._drafters_lock:
            self._drafters_owned += 1
        return drafter

    def release_drafter(self, drafter: Drafter) -> None:
        if drafter.keeps_sequence_state:
            with self._drafters_lock:
                self._idle_drafters.append(drafter)

    def new_draft_length(self, drafter: Drafter | None = None) -> DraftLength:
        """The draft-length policy of one request (gamma auto keeps per-request acceptance), pricing the drafts
        of `drafter`, the request's own (default: the engine's)."""
        if self.curve is None:
            return FixedLength(self.spec.draft_len)
        return AdaptiveLength(self.curve, self.source_costs, lambda: self.draft_cost(drafter))

    def draft_cost(self, drafter: Drafter | None = None) -> float:
        """A draft token's cost as a fraction of a one-token target pass: its weight bytes over the target's
        (decoding is bound by weight reads on a CPU), times the measured price of a draft byte. Read every pass: it
        may follow the request (the sorted draft prices a token by the exits the request has used)."""
        return (drafter or self.drafter).draft_bytes * self.draft_price / self.target_bytes

    def encode(self, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
        if not isinstance(prompt, str):
            raise SpecdraftError(f"encode takes one prompt as a string, got {type(prompt).__name__}")
        if not prompt or not prompt.strip():
            raise SpecdraftError("the prompt is empty; give some text to continue")
        check_text(prompt, "the prompt")
        tokenizer = self.target.tokenizer
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise SpecdraftError(f"{self.target.name!r} has no chat template; pass --no-chat for raw text")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            return self.encode_messages(messages)
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_messages(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise SpecdraftError("no messages to answer")
        if not (isinstance(messages, (list, tuple)) and all(isinstance(m, dict) for m in messages)):
            raise SpecdraftError("messages must be a list of {'role': ..., 'content': text} dicts")
        if not getattr(self.target.tokenizer, "chat_template", None):
            raise SpecdraftError(f"{self.target.name!r} has no chat template, so chat messages cannot be encoded "
                                 "(raw text: --no-chat)")
        for message in messages:
            if isinstance(message.get("content"), str):
                check_text(message["content"], f"a {message.get('role', '')} message")
        ids = self.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def check_prompt_ids(self, prompt_ids) -> list[int]:
        """The prompt as a list of token ids in the target's vocabulary (a 1-D tensor or numpy array is taken too);
        anything else is a clear error, not a wrapped-around index or a TypeError inside the model."""
        if isinstance(prompt_ids, (str, bytes)):
            raise SpecdraftError("generate and stream take token ids; turn text into them with engine.encode(text)")
        if getattr(prompt_ids, "ndim", 1) != 1:  # a batch, e.g. return_tensors="pt" or "np"
            raise SpecdraftError(f"prompt ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()  # floats among them are refused below
        try:
            tokens = iter(prompt_ids)
        except TypeError:
            raise SpecdraftError(f"prompt ids must be a list of token ids, got {prompt_ids!r}") from None
        ids, vocab = [], self.target.vocab_size
        for token in tokens:
            try:
                ids.append(operator.index(token))  # ints, numpy integers; not floats or strings
            except TypeError:
                ids.append(-1)
            if isinstance(token, bool) or not 0 <= ids[-1] < vocab:
                raise SpecdraftError(f"prompt token id {token!r} is not an integer in the vocabulary (0..{vocab - 1})")
        if not ids:
            raise SpecdraftError("the prompt is empty; give some text to continue")
        return ids

    @property
    def max_positions(self) -> int | None:
        """The most positions a request may reach: the target's context, or its drafter's where shorter (a draft
        model's); None: no limit known."""
        limits = [limit for limit in (self.target.max_positions, self.drafter.max_positions) if limit]
        return min(limits) if limits else None

    def stream(self, prompt_ids: list[int], params: SamplingParams, stop_when: StopRule | None = None
               ) -> "Generation":
        """An iterable of text chunks as they become final; `.result()` afterwards has tokens and statistics.
        stop_when: a rule on the text so far that ends the request where it first holds (besides EOS, the stop
        strings and the token budget), e.g. `lambda text: "\\n" in text.lstrip()` for one-line answers."""
        if stop_when is not None and not callable(stop_when):
            raise SpecdraftError(f"stop_when must be a function of the text so far, got {type(stop_when).__name__}")
        prompt_ids = self.check_prompt_ids(prompt_ids)
        limit = self.max_positions
        if limit and len(prompt_ids) + params.max_new_tokens > limit:
            whose = "the model's" if limit == self.target.max_positions else "the draft model's"
            raise SpecdraftError(f"prompt ({len(prompt_ids)} tokens) plus max new tokens ({params.max_new_tokens}) "
                                 f"exceeds {whose} context of {limit} tokens; shorten one of them")
        return Generation(self, list(prompt_ids), params, stop_when)

    def generate(self, prompt_ids: list[int], params: SamplingParams, stop_when: StopRule | None = None
                 ) -> GenerationResult:
        generation = self.stream(prompt_ids, params, stop_when)
        for _ in generation:
            pass
        return generation.result()

    def generate_many(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      stop_when: StopRule | None = None) -> list[GenerationResult]:
        """Several requests decoded together, for offline batches: each target pass scores the pending token and
        the draft of every unfinished request at once (`verify_together`: the weights are read once for all of
        them). Each request gets what `generate` gives it alone: its logits are bit-identical (the kernels are
        batch-invariant), its drafter its own, its sampling its own torch.Generator (seeded from params.seed as
        `generate` seeds it). Prompts are prefilled one by one (with the engine's prefix cache, a prompt that an
        earlier one began is prefilled from there on); with gamma auto each request drafts knowing how full the
        pass is (`propose_together`). stop_when: as `stream`'s, for every request."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise SpecdraftError(f"generate_many takes one SamplingParams or one per prompt: {len(prompts)} prompts, "
                                 f"{len(params_list)} params")
        if len(prompts) > 1 and self.drafter.keeps_sequence_state and self.new_drafter is None:
            raise SpecdraftError(f"drafter {self.drafter.name!r} keeps one sequence's state: build the engine with "
                                 "load_engine (or pass new_drafter=) to decode several requests together")
        generations = [self.stream(prompt, p, stop_when) for prompt, p in zip(prompts, params_list)]
        with torch.inference_mode():
            try:
                active = []
                for generation in generations:
                    generation.open()
                    active.append(generation)
                while active:
                    loops = [generation.loop for generation in active]
                    logits = verify_together(loops, propose_together(loops))
                    still = []
                    for generation, rows in zip(active, logits):
                        _, ended = generation.accept(rows)
                        if ended:
                            generation.close()
                        else:
                            still.append(generation)
                    active = still
            finally:
                for generation in generations:
                    generation.close()
        return [generation.result() for generation in generations]


class Generation:
    """One request in flight: iterate it for text chunks; it owns its torch.Generator and statistics.

    Iterating runs the request alone. A caller that runs several in one pass (`Engine.generate_many`, the
    server's scheduler) drives them instead: `open` (the loop, its drafter, the prompt's prefill), then per pass
    `loop.propose`, the pass, `accept`, until it reports the end; `close` in every case."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 stop_when: StopRule | None = None):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.stats = SpecStats(method=engine.spec.name, gamma=engine.spec.draft_len,
                               gamma_auto=engine.spec.adaptive_gamma, prompt_tokens=len(prompt_ids),
                               backend=engine.target.backend, drafter=dict(engine.drafter.statistics()))
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.checker = StopChecker(engine.target.tokenizer, params.stop, stop_when)
        self.text = ""
        self.done = False
        self.loop: DecodeLoop | None = None
        self._drafter: Drafter | None = None
        self.started = time.perf_counter()

    def __iter__(self) -> Iterator[StreamChunk]:
        if self.done or self.loop is not None:
            raise RuntimeError("a Generation can be iterated only once")
        with torch.inference_mode():
            loop = self.open()
            try:
                ended = False
                while not ended:
                    draft = loop.propose()
                    # verify: one target pass over the pending token and the k draft nodes (a tree: with a mask)
                    chunks, ended = self.accept(loop.state.verify(loop.pending, draft))  # logits [k + 1, V]
                    yield from chunks
            finally:
                self.close()

    def result(self) -> GenerationResult:
        """Text, tokens and statistics, once the generation has ended (iterated to its end, or closed)."""
        if not self.done:
            raise SpecdraftError("the generation has not run yet: iterate it (for chunk in generation) first, or "
                                 "call engine.generate")
        return GenerationResult(text=self.text, token_ids=list(self.checker.token_ids),
                                prompt_ids=list(self.prompt_ids), stats=self.stats)

    def open(self, prefill_by_chunks: bool = False) -> DecodeLoop:
        """Start the request's loop with a drafter of its own (the engine's pool); the prompt is prefilled now, or
        (prefill_by_chunks) by the caller's `loop.prefill` calls."""
        engine = self.engine
        self.started = time.perf_counter()
        self.stats.finish_reason = "length"
        if self._drafter is None:
            self._drafter = engine.acquire_drafter()
        try:
            self.loop = DecodeLoop(engine.target, self._drafter, self.prompt_ids, self.params,
                                   engine.new_draft_length(self._drafter), self.generator, self.stats,
                                   engine.sampling_rule, engine.tree_sampling_rule, prefill_by_chunks,
                                   engine.prefix_cache)
        except BaseException:
            self.close()
            raise
        return self.loop

    def accept(self, target_logits: torch.Tensor) -> tuple[list[StreamChunk], bool]:
        """The loop's pass came back (logits [k + 1, V]): the text that became final and whether the request
        ended (EOS, a stop string, the token budget); at the end the held-back tail comes too."""
        chunk, ended = self.take(self.loop.accept(target_logits))
        ended = ended or self.loop.finished
        chunks = [] if chunk is None else [chunk]
        if ended:
            tail = self.finish()
            chunks += [] if tail is None else [tail]
            self.done = True
        self.text += "".join(chunk.text for chunk in chunks)
        return chunks, ended

    def close(self) -> None:
        """The request ended or was abandoned: the loop lets go of the caches, the drafter goes back to the
        engine. Safe to call more than once."""
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        if self._drafter is not None:
            self.engine.release_drafter(self._drafter)
            self._drafter = None
        self.done = True
        self.close_stats()
    def take(self, tokens: list[int]) -> tuple[StreamChunk | None, bool]:
        """The tokens of one target pass: cut at the budget, an EOS or a stop string. Returns the text that became
        final (None: none) and whether the request ended."""
        params, stats, checker = self.params, self.stats, self.checker
        tokens = tokens[: params.max_new_tokens - len(checker.token_ids)]
        eos_at = next((i for i, t in enumerate(tokens) if t in self.engine.target.eos_token_ids), None)
        if eos_at is not None:
            tokens = tokens[:eos_at]
            stats.finish_reason = "stop"
        text = checker.push(tokens)
        if checker.stopped:
            stats.finish_reason = "stop"
            checker.token_ids = checker.tokens_up_to_stop()
        self.close_stats()
        ended = checker.stopped or eos_at is not None or len(checker.token_ids) >= params.max_new_tokens
        return (StreamChunk(text, tokens) if text else None), ended

    def finish(self) -> StreamChunk | None:
        """The text held back until the end (a possible start of a stop string), if any."""
        tail = self.checker.finish()
        return StreamChunk(tail, []) if tail else None

    def close_stats(self) -> None:
        self.stats.new_tokens = len(self.checker.token_ids)
        self.stats.time_total_s = time.perf_counter() - self.started
