"""What every trainer here shares: the learning-rate schedule, atomic checkpoints with their log, the loss plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


def output_folder(out: str, root: Path) -> Path:
    """A bare name goes under `root` (the cache folder of what is trained); anything with a path separator, or
    starting with ~ or ., is a folder."""
    return Path(out).expanduser() if ("/" in out or out.startswith(("~", "."))) else root / out


def warmup_cosine_lr(step: int, total_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def write_checkpoint(folder: Path, checkpoint: dict, history: list[dict], plot_label: str | list[str],
                     plot_ylabel: str) -> None:
    """checkpoint.pt, train_log.jsonl and loss.png, each replaced atomically (an interruption leaves the last
    complete checkpoint)."""
    tmp = folder / (CHECKPOINT + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, folder / CHECKPOINT)
    with open(folder / (LOG + ".tmp"), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in history)
    os.replace(folder / (LOG + ".tmp"), folder / LOG)
    plot_history(history, folder / "loss.png", plot_label, plot_ylabel)


def plot_history(history: list[dict], path: Path, label: str | list[str] = "draft step {}",
                 ylabel: str = "cross-entropy to the target") -> None:
    """Each record's "step_losses" (one curve per entry, named label[j], or label.format(j + 1) for a format
    string), as a moving mean."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    n_curves = max(len(r["step_losses"]) for r in history)
    window = max(1, len(history) // 50)
    for j in range(n_curves):
        values = [r["step_losses"][j] if j < len(r["step_losses"]) else float("nan") for r in history]
        smooth = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
                  for i in range(len(values))]
        ax.plot(steps, smooth, label=label[j] if isinstance(label, list) else label.format(j + 1))
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{ylabel} (moving mean of {window})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
