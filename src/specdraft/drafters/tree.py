"""Token trees from a draft model: EAGLE-2-style dynamic trees, verified by the target in one pass.

EAGLE-2 (Li et al. 2024) grows the tree by the draft's own confidence: a node's score is the cumulative
log-probability of its path, which tracks how likely the target is to accept it. Per depth, the `branch`
best-scored nodes of the newest level are expanded (one draft forward over that frontier, each node attending to
its own branch only), each gaining its `branch` most likely children; at the end the `budget` best-scored nodes of
all levels form the draft (reranking). A child never scores above its parent (log-probabilities are <= 0), so the
best `budget` nodes always form a tree.

The children are chosen deterministically (top-k, not sampled), so the draft carries no draft_probs: the tree
sampling rule then keeps a child x with probability p(x) and otherwise removes x from p before trying its next
sibling, which is lossless (acceptance.py). Greedy keeps the longest path matching the target's argmax.

`grow_dynamic_tree` only needs a function that scores a frontier, so any drafter that can run its network over
tree nodes (an EAGLE head, a sorted draft) can grow its trees with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel, SequenceState
from ..sampling import processed_probs
from ..types import Draft
from .base import Drafter
from .model import check_compatible_vocab, window_feed, window_start
from .vocab import DraftVocab, HasDraftVocab

# (tokens [n], parents [n]) -> next-token log-scores [n, V]. parents index the nodes expanded by earlier calls
# of the same tree (in call order, 0-based), -1 for a child of the position the root scores came from.
ExpandFrontier = Callable[[list[int], list[int]], torch.Tensor]


@dataclass
class _Candidate:
    token: int
    parent: int  # candidate index, -1 for a child of the root
    score: float  # cumulative log-probability of the path
    depth: int  # 1 for a child of the root
    expanded_as: int = -1  # index among the expanded nodes, once fed to the draft


def grow_dynamic_tree(root_scores: torch.Tensor, expand: ExpandFrontier, depth: int, branch: int,
                      budget: int, min_confidence: float = 0.0) -> tuple[list[int], list[int]]:
    """Grow a dynamic tree and keep its `budget` best nodes.

    root_scores: [V] log-scores of the first draft token. min_confidence: an expanded node gets no children when
    the most likely next token has a lower probability there, under the distribution the scores rank by (greedy:
    the temperature-1 softmax, as the chain's draft_confidence reads; sampling: the sampling distribution); the
    first level is always drafted, as in a chain. Returns (token_ids, parents) of the kept nodes in the order of a
    Draft: parents before children, siblings from the most to the least likely.
    """
    if budget < 1 or depth < 1 or branch < 1:
        raise SpecdraftError(f"a token tree needs budget, depth and branch >= 1 (got {budget}, {depth}, {branch})")
    confidence_floor = math.log(min_confidence) if min_confidence > 0 else float("-inf")  # on the log-scores
    candidates: list[_Candidate] = []
    newest = _add_children(candidates, root_scores, parent=-1, base=0.0, depth=1, branch=branch)
    n_expanded = 0
    for level in range(2, depth + 1):
        kept_scores = sorted((c.score for c in candidates), reverse=True)
        floor = kept_scores[budget - 1] if len(kept_scores) >= budget else float("-inf")
        frontier = sorted(newest, key=lambda i: (-candidates[i].score, i))[:branch]
        frontier = [i for i in frontier if candidates[i].score > floor]  # a child could still make the cut
        if not frontier:
            break
        parents = [-1 if candidates[i].parent < 0 else candidates[candidates[i].parent].expanded_as for i in frontier]
        scores = expand([candidates[i].token for i in frontier], parents)  # [n, V]
        newest = []
        for row, index in enumerate(frontier):
            candidates[index].expanded_as = n_expanded
            n_expanded += 1
            if float(scores[row].max()) < confidence_floor:
                continue  # an unsure node's children are likely rejected
            newest += _add_children(candidates, scores[row], parent=index, base=candidates[index].score,
                                    depth=level, branch=branch)
    ranked = sorted(range(len(candidates)), key=lambda i: (-candidates[i].score, i))[:budget]
    kept = sorted(ranked)  # creation order: parents before children, siblings by decreasing score
    position = {index: slot for slot, index in enumerate(kept)}
    tokens = [candidates[i].token for i in kept]
    parents = [-1 if candidates[i].parent < 0 else position[candidates[i].parent] for i in kept]
    return tokens, parents


def _add_children(candidates: list[_Candidate], scores: torch.Tensor, parent: int, base: float, depth: int,
                  branch: int) -> list[int]:
    """Append the `branch` best children (finite scores only) of one node; return their candidate indices."""
    top = torch.topk(scores, min(branch, scores.shape[-1]))
    added = []
    for score, token in zip(top.values.tolist(), top.indices.tolist()):
        if score == float("-inf"):  # the draft gives it no mass (top-k / top-p filtered): never drafted
            break
        candidates.append(_Candidate(token, parent, base + score, depth))
        added.append(len(candidates) - 1)
    return added


def draft_log_scores(logits: torch.Tensor, params: SamplingParams, vocab: DraftVocab | None = None) -> torch.Tensor:
    """logits [n, V_draft] -> log-scores [n, V] that rank tree candidates: the sampling distribution's
    log-probabilities, or under greedy the temperature-1 softmax (a greedy one-hot would collapse every tree to a
    chain); with a reduced vocabulary, over target ids (-inf outside it)."""
    if params.greedy:
        scores = torch.log_softmax(logits.float(), dim=-1)
    else:
        scores = processed_probs(logits, params).log()
    return scores if vocab is None else vocab.spread(scores, float("-inf"))


def keep_accepted_path(state: SequenceState, context_ids: list[int]) -> None:
    """A drafter's cached tree after the target's verdict: keep the expanded nodes that spell the start of what
    the context added after them (moved to consecutive positions), drop the rest."""
    start = state.tree_start
    region_tokens = state.token_ids[start:]
    path: list[int] = []
    for token in context_ids[start:]:
        parent = path[-1] if path else -1
        child = next((i for i, (p, t) in enumerate(zip(state.tree_parents, region_tokens))
                      if p == parent and t == token), None)
        if child is None:
            break
        path.append(child)
    state.keep_tree_path(path)


class TreeDrafter(HasDraftVocab):
    """An independent draft model drafting EAGLE-2-style dynamic trees (method `draft-tree`).

    The draft's cache holds the context, then the expanded nodes of the current tree as a tree region; after the
    target's verdict the accepted nodes the draft already ran are kept (moved to consecutive positions) and the
    rest is dropped, so the next proposal feeds only what the draft has not seen. As ModelDrafter's: context_tokens,
    the most tokens the draft model reads unseen (0: no limit; `window_feed`); min_confidence, a
    node where the draft's top-1 probability is lower gets no children; draft_vocab, the head rows scored (0: all,
    None: auto; drafters/vocab.py)."""

    name = "draft-tree"

    def __init__(self, draft: LoadedModel, target: LoadedModel, budget: int, depth: int, branch: int,
                 context_tokens: int = 0, min_confidence: float = 0.0, draft_vocab: int | None = 0):
        check_compatible_vocab(draft, target)
        if budget < 1 or depth < 1 or branch < 1:
            raise SpecdraftError(f"tree budget, depth and branch must be >= 1 (got {budget}, {depth}, {branch})")
        self.draft, self.budget, self.depth, self.branch = draft, budget, depth, branch
        self.backend = draft.backend
        self.state = draft.new_state()
        self.context_tokens = context_tokens
        self.context_start = 0  # the draft's cache position 0 is this context index
        self.min_confidence = min_confidence
        self.score_rows(draft, draft_vocab)
        self.max_positions = None if context_tokens else draft.max_positions  # (as ModelDrafter's)

    def begin(self, prompt_ids: list[int], features=None) -> None:
        self.state = self.draft.new_state()
        self.rows_for_prompt(self.state, prompt_ids)
        self.context_start = window_start(prompt_ids, self.context_tokens)

    def propose(self, context_ids, k, params: SamplingParams, generator) -> Draft:
        depth = min(self.depth, k)
        if depth < 1:
            return Draft.empty()
        context_ids = self.readable(context_ids)
        keep_accepted_path(self.state, context_ids[self.context_start:])
        to_feed, self.context_start = window_feed(self.state, context_ids, self.context_start, self.context_tokens)
        root_scores = draft_log_scores(self.state.forward(to_feed, 1), params, self.vocab)[0]  # [V]

        def expand(tokens: list[int], parents: list[int]) -> torch.Tensor:  # one draft pass over the frontier
            return draft_log_scores(self.state.forward_tree(tokens, parents, len(tokens)), params, self.vocab)

        tokens, parents = grow_dynamic_tree(root_scores, expand, depth, self.branch, self.budget, self.min_confidence)
        return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long))

    def on_accept(self, context_ids: list[int], features=None) -> None:
        keep_accepted_path(self.state, self.readable(context_ids[self.context_start:]))


class PromptLookupTreeDrafter(Drafter):
    """Prompt lookup with a tree (method `prompt-lookup-tree`): the continuations of several earlier matches of
    the context's suffix n-grams (longest n-gram first, latest occurrence first), merged into a trie of at most
    `budget` nodes and `depth` levels. No model, deterministic: q is one-hot on every node."""

    name = "prompt-lookup-tree"

    def __init__(self, budget: int, depth: int, max_ngram: int = 3, min_ngram: int = 1):
        if budget < 1 or depth < 1:
            raise SpecdraftError(f"tree budget and depth must be >= 1 (got {budget}, {depth})")
        self.budget, self.depth, self.max_ngram, self.min_ngram = budget, depth, max_ngram, min_ngram

    def begin(self, prompt_ids: list[int], features=None) -> None:
        pass

    def propose(self, context_ids, k, params, generator) -> Draft:
        depth = min(self.depth, k)
        continuations = find_continuations(context_ids, depth, self.max_ngram, self.min_ngram) if depth else []
        tokens, parents = build_trie(continuations, self.budget)
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long))

    def on_accept(self, context_ids: list[int], features=None) -> None:
        pass


def find_continuations(context_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[list[int]]:
    """The up-to-k tokens after every earlier match of a suffix n-gram: longest n first, then latest first."""
    length = len(context_ids)
    found: list[list[int]] = []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if context_ids[start:start + n] == suffix:
                continuation = context_ids[start + n:start + n + k]
                if continuation and continuation not in found:
                    found.append(continuation)
    return found


def build_trie(sequences: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Merge token sequences (in priority order) into a trie of at most `budget` nodes: (tokens, parents), parents
    before children, siblings in the order their first sequence came."""
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            node = child_of.get((parent, token))
            if node is None:
                if len(tokens) == budget:
                    return tokens, parents
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                child_of[(parent, token)] = node
            parent = node
    return tokens, parents
