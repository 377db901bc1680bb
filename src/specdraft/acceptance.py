"""Acceptance rules: pure functions that decide which draft tokens to keep, with slow reference twins.

Words (as in vLLM's rejection sampler):
  accepted   a draft token kept because the target agrees with it;
  recovered  the token emitted at the first rejected position, drawn from norm((p - q)+);
  bonus      the token drawn from p after all k draft tokens were accepted.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) keeps draft token x_i with probability
min(1, p_i(x_i) / q_i(x_i)), left to right. Every emitted token is then distributed exactly as if the target
had sampled it alone. With q one-hot (a deterministic drafter) the rule keeps x with probability p(x) and
recovers from p with x removed.

Shapes: k draft tokens, V vocabulary entries; target_probs has k + 1 rows (the last one is the bonus row).
"""

from __future__ import annotations

import torch

from .config import SamplingParams
from .sampling import processed_probs, sample
from .types import Acceptance, Draft


def accept_greedy(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> Acceptance:
    """Keep the longest draft prefix equal to the target's argmax, then emit the target's own next token.

    draft_ids:     [k] int64
    target_argmax: [k + 1] int64, the target's argmax at each verified position
    """
    k = draft_ids.shape[0]
    mismatch = (draft_ids != target_argmax[:k]).nonzero()
    n_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return Acceptance(n_accepted, target_argmax[: n_accepted + 1].tolist())


def accept_rejection(
    draft_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, V] float32, or None when q is one-hot on draft_ids
    target_probs: torch.Tensor,  # [k + 1, V] float32
    generator: torch.Generator | None,
) -> Acceptance:
    """Speculative rejection sampling, vectorised over the draft; see the module docstring."""
    k = draft_ids.shape[0]
    if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
        # vocabularies of different widths: the ids beyond a model's width have probability 0 under it
        width = max(draft_probs.shape[-1], target_probs.shape[-1])
        draft_probs = torch.nn.functional.pad(draft_probs, (0, width - draft_probs.shape[-1]))
        target_probs = torch.nn.functional.pad(target_probs, (0, width - target_probs.shape[-1]))
    positions = torch.arange(k)
    target_p_of_draft = target_probs[positions, draft_ids]  # [k]
    draft_q_of_draft = draft_probs[positions, draft_ids] if draft_probs is not None else torch.ones(k)  # [k]
    uniforms = torch.rand(k, generator=generator)  # [k]
    # u < p/q, written without the division; q(x) > 0 because x was sampled from q.
    keep = uniforms * draft_q_of_draft < target_p_of_draft  # [k] bool
    rejected = (~keep).nonzero()
    n_accepted = int(rejected[0, 0]) if rejected.numel() else k
    kept = draft_ids[:n_accepted].tolist()
    if n_accepted == k:
        bonus = sample(target_probs[k : k + 1], generator)
        return Acceptance(k, kept + [int(bonus)])
    target_row = target_probs[n_accepted]  # [V]
    if draft_probs is not None:
        draft_row = draft_probs[n_accepted]
    else:
        draft_row = torch.zeros_like(target_row)
        draft_row[draft_ids[n_accepted]] = 1.0
    residual = (target_row - draft_row).clamp_min(0.0)  # [V]
    if residual.sum() <= 0:  # p <= q everywhere means p == q: a rejection had probability 0 (rounding)
        residual = target_row
    recovered = sample((residual / residual.sum()).unsqueeze(0), generator)
    return Acceptance(n_accepted, kept + [int(recovered)])


def reference_accept_rejection(
    draft_ids: list[int],
    draft_probs: list[list[float]] | None,  # [k][V], None for one-hot
    target_probs: list[list[float]],  # [k + 1][V]
    generator: torch.Generator | None,
) -> Acceptance:
    """Slow twin of `accept_rejection`: one token at a time, plain Python arithmetic, same rule."""
    vocab = len(target_probs[0])
    emitted: list[int] = []
    for i, token in enumerate(draft_ids):
        q_row = draft_probs[i] if draft_probs is not None else [1.0 if v == token else 0.0 for v in range(vocab)]
        p_row = target_probs[i]
        u = float(torch.rand(1, generator=generator))
        if u < min(1.0, p_row[token] / q_row[token]):
            emitted.append(token)
            continue
        residual = [max(p - q, 0.0) for p, q in zip(p_row, q_row)]
        total = sum(residual)
        if total <= 0:
            residual, total = list(p_row), sum(p_row)
        emitted.append(_draw([r / total for r in residual], generator))
        return Acceptance(i, emitted)
    emitted.append(_draw(target_probs[len(draft_ids)], generator))
    return Acceptance(len(draft_ids), emitted)


def _draw(probs: list[float], generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from a Python list of probabilities."""
    u = float(torch.rand(1, generator=generator)) * sum(probs)
    cumulative = 0.0
    for token, prob in enumerate(probs):
        cumulative += prob
        if u < cumulative:
            return token
    return max(t for t, prob in enumerate(probs) if prob > 0)  # u fell past the end by rounding


def reference_accept_greedy(draft_ids: list[int], target_argmax: list[int]) -> Acceptance:
    """Slow twin of `accept_greedy`."""
    emitted = []
    for i, token in enumerate(draft_ids):
        if token != target_argmax[i]:
            return Acceptance(i, emitted + [target_argmax[i]])
        emitted.append(token)
    return Acceptance(len(draft_ids), emitted + [target_argmax[len(draft_ids)]])


# ------------------------------------------------------------------------------------------------ trees
#
# A tree draft (types.Draft with parents) is verified in one target pass: row 0 of target_probs scores the
# position after the pending token, row i + 1 the position after node i (the target saw node i's ancestors).
#
# Greedy keeps the longest root-to-leaf path whose every token is the target's argmax after its parent, then
# emits the target's own next token.
#
# Sampling walks down from the root. At a node with target distribution p (the target's row there) it tries the
# node's children in order: child c, token x, drawn from q_c, is kept with probability min(1, p(x) / q_c(x));
# when it is not, p <- norm((p - q_c)+) and the next child is tried with that p. A kept child becomes the
# current node (p: its own target row); when no child is kept the *recovered* token is drawn from the current
# p (the last residual); at a leaf whose parent path was all kept that draw is the *bonus* from its target row.
#
# Lossless, by induction over the siblings (each step is one rejection-sampling step whose "otherwise" branch
# is the rest of the procedure, which by induction emits norm((p - q_c)+)), provided q_c is the distribution
# child c was really drawn from *given its earlier siblings*, and the tree's shape does not depend on the target:
#   - children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling): every q_c = q;
#   - children drawn without replacement from q (recursive rejection sampling): q_c = q with the earlier
#     siblings removed, renormalised;
#   - deterministic children (top-k expansion, EAGLE-2; prompt lookup): q_c one-hot on x, so x is kept with
#     probability p(x), else p <- p with x removed, renormalised. A Draft without draft_probs means this.
# Pairing a scheme with another's rows is not lossless (e.g. i.i.d. rows for children drawn without
# replacement); neither is skipping the residual update between siblings (tests/test_tree.py has both as
# negative controls).


def _children(parents: list[int]) -> list[list[int]]:
    """children[r]: the nodes whose parent row is r (row 0 the pending token, row i + 1 node i), in order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def accept_tree_greedy(draft_ids: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor) -> Acceptance:
    """Keep the longest root-to-leaf path matching the target's argmax, then the target's own next token.

    draft_ids:     [k] int64
    parents:       [k] int64, parents[i] < i, -1 for a child of the pending token
    target_argmax: [k + 1] int64, row 0 after the pending token, row i + 1 after node i
    """
    parent_list = parents.tolist()
    matches = (draft_ids == target_argmax[parents + 1]).tolist()  # [k]: node i is the target's choice after its parent
    path_length = [0] * len(parent_list)  # matched path length ending at node i (0: not on a matched path)
    best = -1
    for node, parent in enumerate(parent_list):
        if matches[node] and (parent < 0 or path_length[parent] > 0):
            path_length[node] = 1 + (path_length[parent] if parent >= 0 else 0)
            if best < 0 or path_length[node] > path_length[best]:
                best = node
    nodes = _path_to(best, parent_list)
    tokens = draft_ids[nodes].tolist() + [int(target_argmax[best + 1])]
    return Acceptance(len(nodes), tokens, nodes)


def accept_tree_rejection(
    draft_ids: torch.Tensor,  # [k] int64
    parents: torch.Tensor,  # [k] int64, parents[i] < i, -1 for a child of the pending token
    draft_probs: torch.Tensor | None,  # [k, V] float32: row c is q_c (see above); None: every child deterministic
    target_probs: torch.Tensor,  # [k + 1, V] float32, row 0 after the pending token, row i + 1 after node i
    generator: torch.Generator | None,
) -> Acceptance:
    """Multi-candidate rejection sampling down a token tree; see the block comment above."""
    if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
        width = max(draft_probs.shape[-1], target_probs.shape[-1])  # ids past a model's width: probability 0
        draft_probs = torch.nn.functional.pad(draft_probs, (0, width - draft_probs.shape[-1]))
        target_probs = torch.nn.functional.pad(target_probs, (0, width - target_probs.shape[-1]))
    children = _children(parents.tolist())
    ids = draft_ids.tolist()
    nodes: list[int] = []
    row = 0
    current = target_probs[0]  # [V] p at the current node, updated to the residual as children are rejected
    while True:
        kept = None
        for child in children[row]:
            token = ids[child]
            draft_q_of_token = float(draft_probs[child, token]) if draft_probs is not None else 1.0
            if float(torch.rand(1, generator=generator)) * draft_q_of_token < float(current[token]):
                kept = child
                break
            if draft_probs is not None:
                residual = (current - draft_probs[child]).clamp_min(0.0)  # [V]
            else:
                residual = current.clone()
                residual[token] = 0.0
            total = residual.sum()
            if total > 0:  # total 0: p <= q everywhere, so p == q and the rejection had probability 0 (rounding)
                current = residual / total
        if kept is None:
            final = int(sample(current.unsqueeze(0), generator))
            return Acceptance(len(nodes), [ids[n] for n in nodes] + [final], nodes)
        nodes.append(kept)
        row = kept + 1
        current = target_probs[row]


def _path_to(node: int, parents: list[int]) -> list[int]:
    """Nodes from the root down to `node` (empty for -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def reference_accept_tree_greedy(draft_ids: list[int], parents: list[int], target_argmax: list[int]) -> Acceptance:
    """Slow twin of `accept_tree_greedy`: enumerate every root-to-node path, keep the longest matching one
    (the first such in node order)."""
    best: list[int] = []
    for node in range(len(draft_ids)):
        path = _path_to(node, parents)
        if all(draft_ids[n] == target_argmax[parents[n] + 1] for n in path) and len(path) > len(best):
            best = path
    last_row = best[-1] + 1 if best else 0
    return Acceptance(len(best), [draft_ids[n] for n in best] + [target_argmax[last_row]], best)


def reference_accept_tree_rejection(
    draft_ids: list[int],
    parents: list[int],
    draft_probs: list[list[float]] | None,  # [k][V], None for deterministic children
    target_probs: list[list[float]],  # [k + 1][V]
    generator: torch.Generator | None,
) -> Acceptance:
    """Slow twin of `accept_tree_rejection`: plain Python lists and arithmetic, recursion over the tree."""
    vocab = len(target_probs[0])

    def walk(row: int, path: list[int]) -> Acceptance:
        p_row = list(target_probs[row])
        for child, parent in enumerate(parents):
            if parent + 1 != row:
                continue
            token = draft_ids[child]
            q_row = draft_probs[child] if draft_probs is not None else [float(v == token) for v in range(vocab)]
            if float(torch.rand(1, generator=generator)) < min(1.0, p_row[token] / q_row[token]):
                return walk(child + 1, path + [child])
            residual = [max(p - q, 0.0) for p, q in zip(p_row, q_row)]
            if sum(residual) > 0:
                p_row = [r / sum(residual) for r in residual]
        return Acceptance(len(path), [draft_ids[n] for n in path] + [_draw(p_row, generator)], path)

    return walk(0, [])


def accept_draft(draft: Draft, target_logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None, chain_rule=accept_rejection,
                 tree_rule=accept_tree_rejection) -> Acceptance:
    """The loop's acceptance step for any draft. A chain is the tree whose nodes have one child each; chains take
    the vectorised chain rules (same outcome distribution, and seeded runs stay as they were before trees).

    target_logits: [k + 1, V] from the verify pass. chain_rule / tree_rule: the sampling rules (tests swap in
    deliberately wrong ones as negative controls)."""
    if params.greedy:
        target_argmax = target_logits.argmax(dim=-1)  # [k + 1]
        if draft.parents is None:
            return accept_greedy(draft.token_ids, target_argmax)
        return accept_tree_greedy(draft.token_ids, draft.parents, target_argmax)
    target_probs = processed_probs(target_logits, params)  # [k + 1, V]
    if draft.parents is None:
        return chain_rule(draft.token_ids, draft.draft_probs, target_probs, generator)
    return tree_rule(draft.token_ids, draft.parents, draft.draft_probs, target_probs, generator)
