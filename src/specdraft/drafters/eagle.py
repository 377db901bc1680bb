"""EAGLE-3-style drafting: a small head reads the target's hidden states and drafts a chain of gamma tokens.

Bookkeeping, with the engine's cache convention (the target has cached every token but the pending last one):
- the head's cache has one row per target position i, computed from the target's taps at i and the token
  after i; rows built from true taps are *committed*;
- the taps of newly cached target positions arrive through `begin` / `on_accept` and wait in `pending` until
  the next `propose` feeds them (so the head's work is counted as drafting time);
- a draft step past the last committed row feeds the head's own previous output with the token it just drafted;
  those rows are dropped (a length change) when the target reports what it kept.

The head's distribution is over its reduced vocabulary; `draft_probs` is spread back over the target's full
vocabulary with probability 0 outside the reduced set, so the acceptance rule stays exact.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..models.adapter import LoadedModel
from ..sampling import processed_probs, sample
from ..types import Draft
from .base import Drafter
from .eagle_head import EagleHead, HeadCache, load_head
from .tree import draft_log_scores, grow_dynamic_tree

# heads loaded by EagleDrafter.load, by (name or path, id of the target)
_LOADED_HEADS: dict[tuple[str, int], tuple[LoadedModel, EagleHead]] = {}


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, head: EagleHead, target: LoadedModel):
        self.head = head.eval()
        self.feature_layers = tuple(head.config.target_layers)  # the target taps the engine keeps for us
        self.cache = HeadCache(head.config)
        self.committed = 0  # head rows built from the target's own taps
        self.pending = torch.empty(0, head.config.hidden_size)  # [n, D] fused taps not yet fed to the head
        self.draft_bytes = head.step_bytes()  # read per draft token (gamma auto weighs draft lengths by it)

    @classmethod
    def load(cls, name_or_path: str, target: LoadedModel) -> EagleDrafter:
        """A drafter over a head loaded once per (head, target): the server builds an engine per request
        configuration, and the head holds no per-sequence state (that lives in the drafter)."""
        key = (name_or_path, id(target))
        if key not in _LOADED_HEADS or _LOADED_HEADS[key][0] is not target:
            if len(_LOADED_HEADS) >= 4:
                _LOADED_HEADS.pop(next(iter(_LOADED_HEADS)))
            head = load_head(name_or_path, target)
            from ..models.native.kernels import load_kernels, unavailable_reason

            if unavailable_reason() is None:  # bf16 copies of its matrices through the native kernels
                head.use_native_bf16(load_kernels())
            _LOADED_HEADS[key] = (target, head)
        return cls(_LOADED_HEADS[key][1], target)


    def statistics(self) -> dict[str, object]:
        return {"draft_backend": "eagle-head"}

    def begin(self, prompt_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.cache = HeadCache(self.head.config, capacity=len(prompt_ids) + 64)
        self.committed = 0
        self.pending = torch.empty(0, self.head.config.hidden_size)
        self._add(features)

    def on_accept(self, context_ids: list[int], features: torch.Tensor | None = None) -> None:
        self.cache.truncate(self.committed)  # drop the rows of speculative steps
        self._add(features)

    def _add(self, features: torch.Tensor | None) -> None:
        """features [n, 3, D_t]: taps of the next n target positions."""
        if features is not None and features.shape[0]:
            with torch.inference_mode():
                self.pending = torch.cat([self.pending, self.head.fuse(features)])  # [n_pending, D]

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        n_pending = self.pending.shape[0]
        # every target pass reports at least one new position; none pending means a one-token prompt
        if k == 0 or n_pending == 0:
            return Draft.empty()
        head = self.head
        with torch.inference_mode():
            self.cache.truncate(self.committed)
            # the token after each pending position; the last one is the pending token context_ids[-1]
            next_ids = torch.tensor(context_ids[self.committed + 1: self.committed + 1 + n_pending])  # [n]
            hidden = head.step(self.pending, next_ids, self.cache)[-1:]  # [1, D]
            self.committed += n_pending
            self.pending = self.pending[:0]
            token_ids: list[int] = []
            rows: list[torch.Tensor] = []
            for i in range(k):
                logits = head.full_vocab_logits(head.draft_logits(hidden))  # [1, V], -inf outside the draft vocab
                if params.greedy:
                    token = int(logits[0].argmax())
                else:
                    probs = processed_probs(logits, params)  # [1, V]
                    token = int(sample(probs, generator))
                    rows.append(probs[0])
                token_ids.append(token)
                if i + 1 < k:
                    hidden = head.step(hidden, torch.tensor([token]), self.cache)  # [1, D], a speculative row
        draft_probs = torch.stack(rows) if rows else None  # [k, V]
        return Draft(torch.tensor(token_ids, dtype=torch.long), draft_probs)


class EagleTreeDrafter(EagleDrafter):
    """The head drafting EAGLE-2-style dynamic trees (method `eagle-tree`): `grow_dynamic_tree` from
    drafters/tree.py, with the head's rows for expanded nodes appended after the committed rows; each node's row
    attends to the committed rows and to its own ancestors' rows (a tree mask), at position committed + depth - 1,
    exactly the rows a chain along that branch would have. All of them are dropped when the target reports
    what it kept (the accepted path's true taps then replace them)."""

    name = "eagle-tree"

    def __init__(self, head: EagleHead, target: LoadedModel, budget: int, depth: int, branch: int):
        super().__init__(head, target)
        self.budget, self.depth, self.branch = budget, depth, branch

    @classmethod
    def load_tree(cls, name_or_path: str, target: LoadedModel, budget: int, depth: int,
                  branch: int) -> EagleTreeDrafter:
        return cls(EagleDrafter.load(name_or_path, target).head, target, budget, depth, branch)

    def propose(self, context_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        n_pending = self.pending.shape[0]
        depth = min(self.depth, k)
        if depth < 1 or n_pending == 0:
            return Draft.empty()
        head, cache = self.head, self.cache
        with torch.inference_mode():
            cache.truncate(self.committed)
            next_ids = torch.tensor(context_ids[self.committed + 1: self.committed + 1 + n_pending])  # [n]
            root_hidden = head.step(self.pending, next_ids, cache)[-1]  # [D]
            self.committed += n_pending
            self.pending = self.pending[:0]
            committed = self.committed
            outputs: list[torch.Tensor] = []  # per expanded node: the head's output [D]
            ancestors: list[list[int]] = []  # per expanded node: expanded indices on its path, itself included

            def expand(tokens: list[int], parents: list[int]) -> torch.Tensor:
                n_before = len(outputs)
                hidden = torch.stack([root_hidden if p < 0 else outputs[p] for p in parents])  # [n, D]
                paths = [([] if p < 0 else ancestors[p]) + [n_before + i] for i, p in enumerate(parents)]
                positions = torch.tensor([committed + len(path) - 1 for path in paths])  # [n]
                visible = torch.zeros(len(tokens), committed + n_before + len(tokens), dtype=torch.bool)
                visible[:, :committed] = True
                for row, path in enumerate(paths):
                    visible[row, [committed + i for i in path]] = True
                out = head.step(hidden, torch.tensor(tokens), cache, positions, visible)  # [n, D]
                outputs.extend(out)
                ancestors.extend(paths)
                return draft_log_scores(head.full_vocab_logits(head.draft_logits(out)), params)  # [n, V]

            root_scores = draft_log_scores(head.full_vocab_logits(head.draft_logits(root_hidden[None])), params)[0]
            tokens, parents = grow_dynamic_tree(root_scores, expand, depth, self.branch, self.budget)
        return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long))
