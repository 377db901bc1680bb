"""The values that flow through the loop: a draft, its acceptance, and the statistics of a generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .draft_length import expected_tokens, expected_tokens_over_passes

DRAFTER_SOURCE = "drafter"  # SpecStats.steps_by_source's key for the drafter's own guesses (no `next_source`)


@dataclass
class Draft:
    """What a drafter proposes for one target pass: a chain, or a tree of candidate continuations.

    token_ids:   [k] int64, the proposed tokens (k may be 0: plain autoregressive decoding).
    draft_probs: [k, V] float32, row i the distribution token i was drawn from, given its earlier siblings
                 (acceptance.py says which sibling schemes are lossless with which rows); None means every
                 token was chosen deterministically (prompt lookup, greedy, top-k tree expansion): q is one-hot.
    parents:     [k] int64 or None. None is a chain (token i follows token i - 1). In a tree, parents[i] is
                 the index of node i's parent, -1 for a child of the pending token; parents come before their
                 children (parents[i] < i) and siblings are listed in the order acceptance tries them.
    labels:      [k] str or None: where each token came from, for the statistics (a sorted draft's exit,
                 e.g. "exit 8"); SpecStats tallies drafted and accepted tokens per label.
    """

    token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    labels: list[str] | None = None

    @classmethod
    def empty(cls) -> Draft:
        """No draft: the pass is a plain target step."""
        return cls(torch.empty(0, dtype=torch.long))

    def __post_init__(self) -> None:
        if self.parents is not None:
            check_tree(self.parents, self.k)

    @property
    def k(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def parent_list(self) -> list[int]:
        """parents as a list, a chain spelled out (-1, 0, 1, ..)."""
        return list(range(-1, self.k - 1)) if self.parents is None else self.parents.tolist()

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path: the most one pass can accept."""
        return max(tree_depths(self.parent_list), default=0)


def check_tree(parents: torch.Tensor, k: int) -> None:
    """parents [k]: every node's parent is -1 or an earlier node."""
    if parents.dim() != 1 or parents.shape[0] != k:
        raise ValueError(f"parents must have shape [{k}], got {list(parents.shape)}")
    if k and not bool(((parents >= -1) & (parents < torch.arange(k))).all()):
        raise ValueError("a tree lists parents before children: need -1 <= parents[i] < i")


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node, 1 for a child of the pending token (parents[i] < i)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class Acceptance:
    """Outcome of checking a draft of k tokens against one target pass.

    n_accepted: how many draft tokens were kept (a prefix of the draft; in a tree, a root-to-node path).
    tokens:     [n_accepted + 1] the tokens to emit: the kept draft tokens, then either the *recovered*
                token (sampled from norm((p - q)+) at the first rejected position; the target's argmax under
                greedy) or, when all k were kept, the *bonus* token sampled from p at position k.
    nodes:      the kept draft nodes, root to leaf (indices into the draft); None means the first n_accepted.
    """

    n_accepted: int
    tokens: list[int]
    nodes: list[int] | None = None

    @property
    def accepted_nodes(self) -> list[int]:
        return list(range(self.n_accepted)) if self.nodes is None else list(self.nodes)


@dataclass
class SpecStats:
    """Statistics of one generation.

    acceptance_rate: accepted / drafted over all draft tokens (tree nodes count as drafted, so a tree's rate is
                     low by construction: compare trees by tau and mean_tree_path).
    alpha:           per-token acceptance probability under the i.i.d. model, estimated as accepted / examined,
                     where a pass examines its accepted tokens plus the one it rejected (if any). It is the
                     estimate that makes predicted_tau comparable with the measured tau.
    tau:             emitted tokens per target pass, the recovered/bonus token included.
    predicted_tau:   (1 - alpha^(gamma+1)) / (1 - alpha), the expectation for that alpha and gamma; with gamma
                     auto, that expectation averaged over the passes at the length each one drafted.
    """

    method: str = "ar"
    gamma: int = 0  # the longest chain a pass may draft (gamma auto: its cap), or the tree depth
    gamma_auto: bool = False  # each pass chose its own draft length (draft_length.py)
    backend: str = ""  # the target's forward: "native" or "transformers"
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    examined: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V a prefix cache gave (not prefilled)
    accepted_per_position: list[int] = field(default_factory=list)  # [gamma]: passes that kept position i
    drafted_per_position: list[int] = field(default_factory=list)  # [gamma]: passes that drafted position i
    tree_passes: int = 0  # passes whose draft was a tree with branches
    tree_nodes: int = 0  # draft nodes in those passes (drafted counts them too)
    tree_accepted: int = 0  # accepted path lengths in those passes
    # chain passes per source (DRAFTER_SOURCE, or the drafter's `next_source`, e.g. "lookup" for a copy):
    # "reached"[i] counts passes that drafted step i + 1 with every earlier step kept, "kept"[i] those that kept
    # it too; kept / reached is the acceptance at a step given the ones before it (offline agreement's twin)
    steps_by_source: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_prefill_s: float = 0.0
    time_total_s: float = 0.0
    finish_reason: str = ""
    # what the drafter reports: its setup (Drafter.statistics: "draft_backend", "draft_vocab", "lookup_first", ...)
    # and its own counters (Drafter.new_tally: e.g. "drafted_by" / "accepted_by" per label of a labelled draft)
    drafter: dict[str, object] = field(default_factory=dict)

    def record(self, draft_len: int, n_accepted: int, depth: int | None = None) -> None:
        """One target pass: draft_len nodes drafted, n_accepted kept. depth: the tree's depth when the draft was
        a tree (None for a chain, whose depth is its length); positions below count depths for trees."""
        depth = draft_len if depth is None else depth
        if depth != draft_len:  # a tree with branches
            self.tree_passes += 1
            self.tree_nodes += draft_len
            self.tree_accepted += n_accepted
        self.target_passes += 1
        self.drafted += draft_len
        self.accepted += n_accepted
        self.examined += min(depth, n_accepted + 1)
        if len(self.drafted_per_position) < depth:
            grow = depth - len(self.drafted_per_position)
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < n_accepted)

    def record_steps(self, source: str, draft_len: int, n_accepted: int) -> None:
        """One chain pass of `source`: draft_len tokens drafted, the first n_accepted of them kept."""
        steps = self.steps_by_source.setdefault(source, {"reached": [], "kept": []})
        reached = min(draft_len, n_accepted + 1)
        for name in ("reached", "kept"):
            steps[name] += [0] * (reached - len(steps[name]))
        for i in range(reached):
            steps["reached"][i] += 1
            steps["kept"][i] += int(i < n_accepted)

    @property
    def mean_draft_len(self) -> float:
        """Draft tokens per target pass."""
        return self.drafted / self.target_passes if self.target_passes else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Draft nodes per tree pass (passes whose draft branched)."""
        return self.tree_nodes / self.tree_passes if self.tree_passes else 0.0

    @property
    def mean_tree_path(self) -> float:
        """Accepted path length per tree pass."""
        return self.tree_accepted / self.tree_passes if self.tree_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined if self.examined else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def predicted_tau(self) -> float:
        if self.gamma == 0:
            return 1.0
        if not self.gamma_auto:
            return expected_tokens(self.alpha, self.gamma)
        return expected_tokens_over_passes(self.alpha, self.target_passes, self.drafted_per_position)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def time_other_s(self) -> float:
        return max(0.0, self.time_total_s - self.time_draft_s - self.time_verify_s - self.time_prefill_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total_s if self.time_total_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The statistics as JSON: with gamma auto, "gamma" is "auto", "gamma_max" the cap, and "mean_draft_len"
        the length the passes drafted on average."""
        out = asdict(self)
        for name in ("acceptance_rate", "alpha", "tau", "predicted_tau", "acceptance_per_position",
                     "time_other_s", "tokens_per_s", "mean_draft_len", "mean_tree_size", "mean_tree_path"):
            out[name] = getattr(self, name)
        if self.gamma_auto:
            out["gamma"], out["gamma_max"] = "auto", self.gamma
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: SpecStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "stats": self.stats.to_dict()}
