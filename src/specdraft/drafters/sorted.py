"""S2D-style sorted drafting (Kavehzadeh et al. 2024): one draft network whose first layers form nested
sub-models, each an exit through the shared final norm and LM head; each draft token stops at the shallowest
exit that is confident enough.

Exactness. The token a step emits is sampled from the distribution of the exit it stopped at, and that
distribution is what `draft_probs` carries, so the acceptance rule stays exact whatever the exit rule does.
Soundness of the cache: a token that stopped at depth e has K/V in layers < e only. When a later token goes
deeper, `LayeredState.run_to` first runs the missing layers for every earlier token from the residual stream it
kept at its own depth (LayerSkip's "fill the skipped layers", done lazily). Each exit therefore sees exactly the
K/V that running its sub-model alone over the whole sequence would produce: the native kernels are batch
invariant, so it is bit for bit the same (tests/test_sorted.py checks this against a truncated model).

Self-speculation. When the target is the draft's own parent (its first layers through the deepest exit are the
same weights), the draft computes no K/V the target has: after the target's prefill and after every verify pass
it copies the target's K/V of the prompt and of every accepted token, at every depth (`LayeredState.adopt`), and
runs only its own draft tokens. Without this, the prompt ran through the draft's layers a second time, doubling
the prefill of a long prompt. The engine hands the target's state over through the optional drafter member
`use_target_state`.

Bookkeeping. Filled depths never increase along the sequence (a token that goes deeper fills every earlier token
first), so at any layer the positions still missing it are a suffix: one kernel call per layer fills them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..registry import parse_exit_rule
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel, SequenceState
from ..models.native.gguf_weights import stored_bytes
from ..models.native.llama import NativeCache, NativeLlama
from ..sampling import processed_probs, sample
from ..types import Draft
from .base import DraftTally, LabelTally
from .exit_adapters import ExitAdapters, find_shipped, load_adapters
from .model import check_compatible_vocab
from .tree import draft_log_scores, grow_dynamic_tree, keep_accepted_path
from .vocab import HasDraftVocab, resolve_rows


class LayeredState(SequenceState):
    """One sequence in a native model whose layers are filled to different depths per position. Rollback and
    catch-up (`truncate`, `sync`, `sync_for_next`) are SequenceState's; dropping positions shortens every layer.

    layer_length[l]: the positions 0 .. layer_length[l] - 1 have K/V in layer l (non-increasing in l);
    residual[t]:     [D] the residual stream of position t at its filled depth (the input of its first missing
                     layer, or the output of the last layer run)."""

    def __init__(self, native: NativeLlama, capacity: int = 256):
        super().__init__()
        self.native = native
        self.cache = native.new_cache(capacity)
        self.layer_length = [0] * len(native.layers)
        self.residual = torch.zeros(capacity, native.embed.shape[1])  # [capacity, D] float32
        # positions 0 .. adopted_length - 1 took their K/V through layer adopted_depth - 1 from another model
        # (`adopt`): their residual rows are stale, so no layer past those may run over them
        self.adopted_length, self.adopted_depth = 0, len(native.layers)
        self.node_layers = len(native.layers)  # layers `forward` runs tree nodes through (set per tree)

    def depth(self, position: int) -> int:
        """How many layers position has run through."""
        return sum(1 for length in self.layer_length if length > position)

    def append(self, token_ids: list[int]) -> None:
        """Add positions at depth 0 (their embeddings); layers run when some exit needs them."""
        n, n_new = len(self.token_ids), len(token_ids)
        if n + n_new > self.native.max_positions:
            raise SpecdraftError(f"position {n + n_new} is past the draft's {self.native.max_positions} positions")
        self.cache.reserve(n + n_new)
        if n + n_new > self.residual.shape[0]:
            grown = torch.zeros(max(n + n_new, 2 * self.residual.shape[0]), self.residual.shape[1])
            grown[:n] = self.residual[:n]
            self.residual = grown
        self.residual[n: n + n_new] = self.native.embed_tokens(token_ids)
        self.token_ids.extend(token_ids)

    def run_to(self, depth: int) -> None:
        """Bring every position to at least `depth` layers: at each layer, the positions still missing it (a
        suffix, all at exactly that depth) go through it in one call."""
        n = len(self.token_ids)
        for index in range(depth):
            start = self.layer_length[index]
            if start >= n:
                continue
            if index >= self.adopted_depth and start < self.adopted_length:
                raise AssertionError(f"layer {index} over adopted positions from {start}: their residuals are stale")
            rows = self.residual[start:n]  # [T, D]
            self.residual[start:n] = self.native.layer_forward(index, rows, self.cache, start)
            self.layer_length[index] = n
        self.cache.length = self.layer_length[0]

    def adopt(self, source: NativeCache, length: int, depth: int) -> None:
        """Fill layers 0 .. depth - 1 of positions 0 .. length - 1 with the K/V another model cached for the same
        tokens (the target, when its first `depth` layers are the draft's own: SortedDrafter checks), running
        nothing. The adopted rows' residuals go stale; that is sound while nothing runs deeper than `depth` (a
        residual row is read only to run a layer its position is missing), and `run_to` refuses to."""
        if length > len(self.token_ids) or length > source.length:
            raise AssertionError(f"cannot adopt {length} positions: {len(self.token_ids)} here, {source.length} there")
        start = self.layer_length[depth - 1]  # the shallowest fill among these layers (depths never increase)
        if start >= length:
            return
        self.cache.copy_from(source, depth, start, length)
        self.layer_length[:depth] = [max(filled, length) for filled in self.layer_length[:depth]]
        self.cache.length = self.layer_length[0]
        self.adopted_length, self.adopted_depth = max(self.adopted_length, length), min(self.adopted_depth, depth)

    def last_residual(self) -> torch.Tensor:
        """The last position's residual stream at its current depth: [1, D]."""
        return self.residual[len(self.token_ids) - 1: len(self.token_ids)]

    def _drop_last(self, n: int) -> None:
        """Positions before the cut keep their residual rows and depths."""
        length = len(self.token_ids) - n
        self.layer_length = [min(filled, length) for filled in self.layer_length]
        self.cache.length = self.layer_length[0]
        self.adopted_length = min(self.adopted_length, length)

    # token trees (method sorted-tree): SequenceState.forward_tree builds the mask and positions and calls forward

    def forward(self, new_ids: list[int], n_logits: int, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append `new_ids` and run them through the first `node_layers` layers (a tree's exit depth), with a
        tree's positions [T] and mask [T, W] when given. Returns their residual rows at that depth, [n_logits, D],
        not logits: the exit (its norm, adapter and head) is the drafter's. Every earlier position must have run
        those layers already (the root's exit brought all of them there), so the new rows are the only ones
        missing them and depths stay non-increasing along the sequence."""
        depth, n = self.node_layers, len(self.token_ids)
        if any(self.layer_length[index] != n for index in range(depth)):
            raise AssertionError(f"a tree at depth {depth} needs every earlier position filled that deep")
        self.append(new_ids)
        rows = self.residual[n: n + len(new_ids)]  # [T, D] embeddings
        for index in range(depth):
            rows = self.native.layer_forward(index, rows, self.cache, n, positions, tree_mask)
            self.layer_length[index] = n + len(new_ids)
        self.residual[n: n + len(new_ids)] = rows
        self.cache.length = self.layer_length[0]
        return rows[len(new_ids) - n_logits:]

    def _move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """A kept tree path: K/V (of every layer; deeper than the tree's they are unfilled slots either way) and
        residual rows move together."""
        self.cache.move(source, destination)
        self.residual[destination] = self.residual[source]


# ------------------------------------------------------------------------------------------------ exit rules

@dataclass(frozen=True)
class ThresholdExit:
    """S2D's rule: stop at exit i when its top-1 probability exceeds thresholds[i] (the drafter never asks at
    the last exit: it always stops there); exits past the tuple reuse its last threshold.

    signal "top1": the exit's top-1 probability (the LM head runs at every exit passed); "probe": the trained exit
    probe's probability that the exit agrees with the draft's last layer (the head runs once, where it stops)."""

    thresholds: tuple[float, ...] = (0.5,)
    signal: str = "top1"

    def stop(self, exit_index: int, top1: float) -> bool:
        return top1 > self.thresholds[min(exit_index, len(self.thresholds) - 1)]


@dataclass(frozen=True)
class CostAwareExit:
    """Stop at exit i when 1 - top1 (the chance this token is wrong and wastes the rest of the draft) is at most
    `weight` times the cost of the layers beyond exit i, measured as a fraction of one target pass (weight bytes
    read). Deep layers that are cheap next to the target are worth running unless the exit is nearly sure;
    expensive ones only when it is unsure. remaining_cost[i]: the layers after exit i over the target's bytes.
    signal "probe" (rule cost-probe:W) reads the trained exit probe's probability in place of the top-1."""

    remaining_cost: tuple[float, ...]
    weight: float = 1.0
    signal: str = "top1"

    def stop(self, exit_index: int, top1: float) -> bool:
        return 1.0 - top1 <= self.weight * self.remaining_cost[exit_index]


def layer_bytes(native: NativeLlama, index: int) -> int:
    layer = native.layers[index]
    return sum(stored_bytes(t) for t in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down))


def cost_aware_rule(draft: NativeLlama, target: LoadedModel, exits: tuple[int, ...], weight: float,
                    signal: str = "top1") -> CostAwareExit:
    target_bytes = target.weight_bytes
    per_layer = [layer_bytes(draft, i) for i in range(len(draft.layers))]
    remaining = tuple(sum(per_layer[e: exits[-1]]) / target_bytes for e in exits)
    return CostAwareExit(remaining, weight, signal)


# ------------------------------------------------------------------------------------------------ drafter

EXIT_COST_PRIOR = 4  # draft tokens at the deepest exit that stand in for a request's exits before it has drafted


class SortedDrafter(HasDraftVocab):
    """Drafts a chain of gamma tokens; each token leaves at the first exit the rule accepts.

    exits: layer counts (ascending), e.g. (8, 16, 24): sub-model i is the first exits[i] layers followed by the
    shared final norm and LM head (or, with trained `adapters`, that exit's own norm and adapter before the shared
    head: drafters/exit_adapters.py). `exit_counts[i]` counts the tokens drafted at exit i (also in each Draft's
    labels, which the loop's statistics tally). draft_vocab > 0: score only those rows of the head
    (drafters/vocab.py)."""

    name = "sorted"
    backend = "native"

    def __init__(self, draft: LoadedModel, target: LoadedModel, exits: tuple[int, ...], rule,
                 adapters: ExitAdapters | None = None, draft_vocab: int = 0):
        check_compatible_vocab(draft, target)
        native = _require_native(draft)
        n_layers = len(native.layers)
        if not exits or list(exits) != sorted(set(exits)) or exits[0] < 1 or exits[-1] > n_layers:
            raise SpecdraftError(f"exits must be increasing layer counts between 1 and {n_layers} "
                                 f"(the draft's depth), got {','.join(map(str, exits)) or 'none'}")
        self.native = native
        self.max_positions = native.max_positions
        self.exits = tuple(exits)
        self.rule = rule
        self.exit_counts = [0] * len(exits)
        self.state = LayeredState(self.native)
        self.adapters = adapters
        # per exit: the norm weight [D] float32 its row is normalised with (the final norm's, or its own)
        self.adapter_rows = [None if adapters is None else adapters.exit_index(e) for e in self.exits]
        self.exit_norms = [native.final_norm if row is None else adapters.norm[row].detach().float().contiguous()
                           for row in self.adapter_rows]
        self.choose_rows(draft, draft_vocab or 0)  # resolved by from_config; 0 (or None): all rows
        # bytes a token leaving at exit i reads: the layers up to it, and the head rows once per exit that ran
        # the head (a probe rule decides before the head, so only the exit it stops at runs it)
        head_bytes = self.scored_head_bytes(native)
        self.exit_bytes = tuple(sum(layer_bytes(native, layer) for layer in range(depth))
                                + head_bytes * (1 if rule.signal == "probe" else i + 1)
                                for i, depth in enumerate(self.exits))
        self.request_exits = [0] * len(exits)  # this request's draft tokens per exit (gamma auto prices by them)
        # self-speculation: when the target's first layers are the draft's own through the deepest exit, the draft
        # takes the K/V the target cached (the prompt, every accepted token) instead of computing them again
        self.shares_target = target.native is not None and native.same_first_layers(target.native, self.exits[-1])
        self.target_state: SequenceState | None = None

    @property
    def draft_bytes(self) -> float:
        """Bytes a draft token reads, as this request has drafted so far: the mean over its tokens' exits, with
        EXIT_COST_PRIOR tokens at the deepest exit standing in before any (gamma auto reads it every pass; it
        had priced every token at the deepest exit, which on the draft's own parent as target is a whole target
        pass). A property: this drafter calls HasDraftVocab.choose_rows, not score_rows (which sets draft_bytes)."""
        tokens = sum(self.request_exits)
        spent = sum(n * b for n, b in zip(self.request_exits, self.exit_bytes))
        return (spent + EXIT_COST_PRIOR * self.exit_bytes[-1]) / (tokens + EXIT_COST_PRIOR)

    @classmethod
    def build(cls, draft: LoadedModel, target: LoadedModel, exits: tuple[int, ...], exit_rule: str,
              sorted_draft: str = "auto", draft_vocab: int | None = None, **tree_knobs) -> SortedDrafter:
        """From the shared config. sorted_draft: trained adapters by name or folder, "auto" (the shipped ones for
        this draft, if any) or "none". exits () means the adapters' exits, or else half, three quarters and all of
        the draft's layers. draft_vocab 0 or None (auto) means the adapters' training vocabulary; without adapters
        0 is the whole vocabulary and None the automatic choice (vocab.resolve_rows). tree_knobs (budget, depth,
        branch) go to SortedTreeDrafter."""
        native = _require_native(draft)
        n_layers = len(native.layers)
        adapters = None
        if sorted_draft not in ("none", ""):
            source = find_shipped(native.final_norm, native.lm_head) if sorted_draft == "auto" else sorted_draft
            if source is not None:
                adapters = load_adapters(source, native.final_norm, native.lm_head)
        if adapters is not None:
            exits = exits or adapters.config.exits
            draft_vocab = draft_vocab or adapters.config.draft_vocab
        draft_vocab = resolve_rows(draft_vocab, native)
        exits = exits or tuple(sorted({max(1, n_layers // 2), max(1, 3 * n_layers // 4), n_layers}))
        kind, numbers = parse_exit_rule(exit_rule)
        if kind in ("cost", "cost-probe"):
            rule = cost_aware_rule(draft.native, target, exits, numbers[0],
                                   signal="probe" if kind == "cost-probe" else "top1")
        else:
            rule = ThresholdExit(numbers, signal="probe" if kind == "probe" else "top1")
        if rule.signal == "probe" and (adapters is None or not adapters.config.probes):
            raise SpecdraftError(f"exit rule {exit_rule!r} needs a sorted draft trained with exit probes; "
                                 f"{'there is none' if adapters is None else repr(adapters.config.draft) + ' has none'}"
                                 f" (train one with `specdraft train sorted`, or use threshold:T)")
        return cls(draft, target, exits, rule, adapters, draft_vocab, **tree_knobs)

    def use_target_state(self, target_state: SequenceState | None) -> None:
        """The engine hands over the target's sequence of the request about to begin, and None when it ends
        (optional protocol member); it is read only when the target's layers are the draft's own
        (`shares_target`)."""
        self.target_state = target_state if self.shares_target else None

    def new_tally(self) -> DraftTally:
        return LabelTally()  # each token labelled with the exit that drafted it

    def begin(self, prompt_ids: list[int], features=None) -> None:
        if self.vocab is not None:
            self.vocab.for_prompt(prompt_ids)
        self.state = LayeredState(self.native, capacity=len(prompt_ids) + 64)
        self.request_exits = [0] * len(self.exits)
        # a state handed over for another request is dropped: the draft then computes as an independent one does
        self.target_state = self._target_holding(prompt_ids[:-1])
        if len(prompt_ids) > 1:  # the prompt goes to the deepest exit: adopted, or one pass per layer
            self.state.append(prompt_ids[:-1])
            if self.target_state is not None:
                self.state.adopt(self.target_state.cache, len(prompt_ids) - 1, self.exits[-1])
            else:
                self.state.run_to(self.exits[-1])

    def _target_holding(self, cached_ids: list[int]) -> SequenceState | None:
        """The shared target's state if it caches exactly `cached_ids`, else None."""
        target = self.target_state
        return target if target is not None and target.token_ids == cached_ids else None

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        to_feed = self.state.sync_for_next(context_ids)
        self.state.append(to_feed)
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        labels: list[str] = []
        for i in range(k):
            logits, exit_index = self._exit()  # [1, V_draft]
            if params.greedy:
                index = int(logits[0].argmax())
            else:
                probs = processed_probs(logits, params)  # [1, V_draft]: q is the chosen exit's distribution
                index = int(sample(probs, generator))
                rows.append(probs[0])
            token = index if self.vocab is None else self.vocab.target_id(index)
            token_ids.append(token)
            labels.append(f"exit {self.exits[exit_index]}")
            self.exit_counts[exit_index] += 1
            self.request_exits[exit_index] += 1
            if i + 1 < k:
                self.state.append([token])
        draft_probs = torch.stack(rows) if rows else None  # [k, V_draft]
        if draft_probs is not None and self.vocab is not None:
            draft_probs = self.vocab.spread(draft_probs)  # [k, V]: q is 0 outside the rows drafted from
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs, labels=labels)

    def exit_hidden(self, exit_index: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The rows for the LM head at exit `exit_index` of residual rows at that depth [n, D] (default: the last
        position's, whose depth must be filled): [n, D]."""
        native = self.native
        rows = self.state.last_residual() if rows is None else rows
        normed = native.ops.rms_norm(rows.contiguous(), self.exit_norms[exit_index], native.eps)  # [n, D]
        if self.adapters is not None:
            normed = self.adapters.adapt_normed(normed, self.adapter_rows[exit_index])
        return normed.contiguous()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, V_draft] through the shared head (the reduced rows, when there are)."""
        head = self.native.full_head() if self.vocab is None else self.vocab.weight
        return self.native.soft_capped(self.native._linear(hidden, head, None))

    def exit_logits(self, exit_index: int) -> torch.Tensor:
        """The last position's logits at exit `exit_index`: [1, V_draft]."""
        return self.head_logits(self.exit_hidden(exit_index))

    def _exit(self) -> tuple[torch.Tensor, int]:
        """Run the last position exit by exit until the rule stops it: (its logits [1, V_draft], the exit index)."""
        last = len(self.exits) - 1
        for exit_index, depth in enumerate(self.exits):
            self.state.run_to(depth)
            hidden = self.exit_hidden(exit_index)  # [1, D]
            if exit_index == last:
                return self.head_logits(hidden), exit_index
            if self.rule.signal == "probe":  # decide first, then run the head only where the token stops
                signal = float(torch.sigmoid(self.adapters.probe_logit(hidden, self.adapter_rows[exit_index])))
                if self.rule.stop(exit_index, signal):
                    return self.head_logits(hidden), exit_index
                continue
            logits = self.head_logits(hidden)  # [1, V_draft]
            if self.rule.stop(exit_index, float(logits[0].softmax(-1).max())):
                return logits, exit_index
        raise AssertionError("unreachable: the last exit always stops")

    def on_accept(self, context_ids: list[int], features=None) -> None:
        self.state.sync(context_ids)  # drop rejected draft positions; the new token is fed at the next propose
        self._adopt_accepted(context_ids)

    def _adopt_accepted(self, context_ids: list[int]) -> None:
        """A shared target has just cached every token but the new pending one: take their K/V at every depth
        (the accepted drafts stopped at shallow exits; the last accepted one the draft never ran)."""
        cached = len(context_ids) - 1
        target = self._target_holding(context_ids[:cached])
        if target is None:
            return  # no shared target, or it does not hold this context: deeper layers fill when a token needs them
        self.state.append(context_ids[len(self.state):cached])
        self.state.adopt(target.cache, cached, self.exits[-1])


class SortedTreeDrafter(SortedDrafter):
    """Dynamic token trees from the sorted draft (method `sorted-tree`): the pending token leaves at the exit the
    rule picks, as in a chain, and the whole tree is then grown at that exit (drafters/tree.py's EAGLE-2 growth,
    every frontier one pass through the exit's layers with a tree mask). A confident position drafts its tree
    with few layers, a hard one with more.

    Exact: children are chosen deterministically (top-k), so the tree rule's one-hot q applies (acceptance.py),
    and the exit depends only on the draft's own confidence. Cache: tree nodes have K/V in the tree's layers
    only; the accepted ones stay as positions of that depth, which `LayeredState.run_to` deepens when a later
    token goes deeper, as for a chain token that left early."""

    name = "sorted-tree"

    def __init__(self, draft: LoadedModel, target: LoadedModel, exits: tuple[int, ...], rule,
                 adapters: ExitAdapters | None = None, draft_vocab: int = 0, budget: int = 5, depth: int = 4,
                 branch: int = 2):
        super().__init__(draft, target, exits, rule, adapters, draft_vocab)
        if budget < 1 or depth < 1 or branch < 1:
            raise SpecdraftError(f"tree budget, depth and branch must be >= 1 (got {budget}, {depth}, {branch})")
        self.budget, self.depth, self.branch = budget, depth, branch

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        depth = min(self.depth, k)
        if depth < 1:
            return Draft.empty()
        keep_accepted_path(self.state, context_ids)
        self.state.append(self.state.sync_for_next(context_ids))
        logits, exit_index = self._exit()  # [1, V_draft]: the pending token at the exit the rule picked
        self.exit_counts[exit_index] += 1
        self.request_exits[exit_index] += 1
        self.state.node_layers = self.exits[exit_index]

        def expand(tokens: list[int], parents: list[int]) -> torch.Tensor:  # one pass of the exit's layers
            rows = self.state.forward_tree(tokens, parents, len(tokens))  # [n, D] at the exit's depth
            return self._full_scores(self.head_logits(self.exit_hidden(exit_index, rows)), params)  # [n, V]

        tokens, parents = grow_dynamic_tree(self._full_scores(logits, params)[0], expand, depth, self.branch,
                                            self.budget)
        return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long),
                     labels=[f"exit {self.exits[exit_index]}"] * len(tokens))

    def _full_scores(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[n, V_draft] logits -> [n, V] log-scores over target ids (-inf outside a reduced vocabulary)."""
        return draft_log_scores(logits, params, self.vocab)

    def on_accept(self, context_ids: list[int], features=None) -> None:
        keep_accepted_path(self.state, context_ids)
        self._adopt_accepted(context_ids)


def _require_native(draft: LoadedModel) -> NativeLlama:
    if draft.native is None:
        raise SpecdraftError(f"sorted drafting runs layer slices on the native backend; {draft.name!r} is on "
                             f"transformers ({draft.backend_note}); use a Llama/Qwen2/Qwen3/Mistral draft")
    return draft.native
