"""Training settings (no torch import: the CLI builds its parser from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecdraftError


@dataclass
class TrainConfig:
    data: str  # a collected feature folder (train/eagle_data.collect)
    out: str  # a head name (saved under ~/.cache/specdraft/heads/NAME) or a folder
    steps: int | None = None  # optimizer steps (one window each); None: `epochs` passes over the data
    epochs: float = 1.5
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

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise SpecdraftError("--ttt-steps must be >= 1")
        if self.steps is not None and self.steps < 1:
            raise SpecdraftError("--steps must be >= 1")
        if self.draft_vocab < 2:
            raise SpecdraftError("--draft-vocab must be >= 2")
