"""Training settings (no torch import: the CLI builds its parser from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import resolve_dtype
from ..errors import SpecdraftError
from .prose import PROSE_KINDS


@dataclass
class TrainConfig:
    data: str  # a collected feature folder (train/eagle_data.collect), or several joined by +
    out: str  # a head name (saved under ~/.cache/specdraft/heads/NAME) or a folder
    steps: int | None = None  # optimizer steps (one window each); None: `epochs` passes over the data
    # 3 passes: held-out agreement 0.512 / 0.453 / 0.408 (draft steps 1-3) after 1.5 -> 0.552 / 0.513 / 0.474 after
    # 3 on the same 145k tokens (2026-12-01, docs/eagle.md); the training loss then sits below the held-out one,
    # so more passes would need more data
    epochs: float = 3.0
    ttt_steps: int = 3  # unrolled draft steps per training step
    step_weight: float = 0.8  # loss weight of unrolled step j is step_weight ** (j - 1)
    lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    draft_vocab: int = 8192
    intermediate_size: int | None = 2048  # None: the target's own (EAGLE-3's choice; 2.2x the cost here)
    window: int = 256  # tokens per training step: collected sequences are cut into windows this long
    validation_fraction: float = 0.03  # sequences held out (the last ones of the ranked corpus)
    checkpoint_every: int = 50
    seed: int = 0
    # the products' dtype in a training step: "bfloat16" runs them under torch.autocast (the parameters, the
    # optimizer and the loss's softmax stay float32); auto: bfloat16 where the CPU computes it natively. Same 240
    # steps from the same start (2026-12-01, prose-s14 features): held out 0.428 / 0.372 / 0.331 in bf16 against
    # 0.403 / 0.376 / 0.322 in fp32, at 1.7x the speed (195 s against 320 s)
    compute_dtype: str = "auto"
    # go on from this trained head (a name under ~/.cache/specdraft/heads or a folder) instead of a fresh one:
    # fine-tuning on new text; the head keeps its shapes and draft vocabulary, the optimizer and schedule start anew
    init: str | None = None

    def __post_init__(self) -> None:
        from ..config import resolve_dtype

        if self.compute_dtype == "auto":
            self.compute_dtype = resolve_dtype("auto")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise SpecdraftError(f"--compute-dtype must be auto, float32 or bfloat16, got {self.compute_dtype!r}")
        if self.ttt_steps < 1:
            raise SpecdraftError("--ttt-steps must be >= 1")
        if self.steps is not None and self.steps < 1:
            raise SpecdraftError("--steps must be >= 1")
        if self.draft_vocab < 2:
            raise SpecdraftError("--draft-vocab must be >= 2")
        if self.window < 8:
            raise SpecdraftError(f"--window must be at least 8 tokens, got {self.window}")
        if not self.epochs > 0:
            raise SpecdraftError(f"--epochs must be > 0, got {self.epochs}")
        if self.checkpoint_every < 1:
            raise SpecdraftError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.warmup_steps < 0:
            raise SpecdraftError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.validation_fraction < 1:
            raise SpecdraftError(f"the validation fraction must be in (0, 1), got {self.validation_fraction}")
        check_optimizer(self.lr, self.weight_decay, self.grad_clip, self.min_lr_ratio)


def check_optimizer(lr: float, weight_decay: float, grad_clip: float, min_lr_ratio: float) -> None:
    """The optimizer settings both trainers share, checked before any data or model is read."""
    if not lr > 0:
        raise SpecdraftError(f"--lr must be > 0, got {lr}")
    if not weight_decay >= 0:
        raise SpecdraftError(f"--weight-decay must be >= 0, got {weight_decay}")
    if not grad_clip > 0:
        raise SpecdraftError(f"the gradient clip must be > 0, got {grad_clip}")
    if not 0 <= min_lr_ratio <= 1:
        raise SpecdraftError(f"the final learning-rate ratio must be in [0, 1], got {min_lr_ratio}")


LOSSES = ("text", "self", "both")


@dataclass
class SortedTrainConfig:
    out: str  # a name (saved under ~/.cache/specdraft/sorted/NAME) or a folder
    draft: str = "qwen2.5-coder-0.5b-instruct"
    exits: tuple[int, ...] = (6, 12, 18, 24)
    rank: int = 64
    draft_vocab: int = 32768
    loss: str = "self"
    steps: int = 600
    window: int = 256
    windows_per_step: int = 2
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 25
    validation_windows: int = 8
    validate_against: tuple[str, ...] = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    seed: int = 0
    max_len: int = 512  # tokens per corpus document (longer ones are cut), then split into windows
    corpus: str = "packages"  # packages, chats:NAME (train/chats.py), or both joined by +
    init: str | None = None  # start from these adapters (name or folder; e.g. the shipped ones) instead of identity
    # what the exit probes predict agreement with: "self" (the draft's last exit, the token it falls back to) or a
    # served model by name or path (its greedy token: the acceptance of a greedy draft token at that exit)
    probe_target: str = "self"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise SpecdraftError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not self.exits or list(self.exits) != sorted(set(self.exits)) or self.exits[0] < 1:
            raise SpecdraftError(f"--exits must be increasing layer counts >= 1, got {self.exits}")
        for name in ("rank", "draft_vocab", "steps", "window", "windows_per_step", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.window < 8:
            raise SpecdraftError("--window must be at least 8 tokens")
        if self.warmup_steps < 0:
            raise SpecdraftError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        check_optimizer(self.lr, self.weight_decay, self.grad_clip, self.min_lr_ratio)


# the first kinds, built from the pinned packages and a few generators (one seeded stream draws them all)
PACKAGE_KINDS = ("chat", "translate", "summarize", "qa", "rag", "math", "code", "explain")
KINDS = PACKAGE_KINDS + PROSE_KINDS  # prose kinds (train/prose.py) draw from a stream of their own


# `specdraft train chats` (train/chats.py): here, so that the command line reads its defaults without torch
@dataclass
class ChatsConfig:
    out: str  # a name (saved under ~/.cache/specdraft/chats/NAME) or a folder
    model: str = "qwen2.5-coder-0.5b-instruct"
    tokens: int = 100_000  # stop once the answers hold this many tokens
    per_kind: int = 150  # prompts built per kind (the run stops at `tokens` first, normally)
    batch: int = 32  # prompts decoded together
    max_new_tokens: int = 256
    temperature: float = 0.7
    seed: int = 0
    threads: int | None = None
    kinds: tuple[str, ...] = KINDS
    dtype: str = "auto"  # bfloat16 where the CPU computes it natively (2x the tokens/s of float32 there)

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise SpecdraftError(f"--kinds takes distinct kinds from {', '.join(KINDS)}; got {', '.join(self.kinds)}")
        for name in ("tokens", "per_kind", "batch", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise SpecdraftError("--temperature must be > 0: the corpus is sampled")
        resolve_dtype(self.dtype)  # a clear error for an unknown name
