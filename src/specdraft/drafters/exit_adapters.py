"""The trained part of a sorted (S2D) draft: a small adapter per exit, on top of the draft's frozen weights.

An exit of a pretrained model (its first e layers, then the final norm and LM head) drafts poorly: the residual
stream at depth e is not yet in the basis the head reads ("logit lens"). A learned translation per depth fixes
much of that ("tuned lens", Belrose et al. 2023). Here, per exit e:

    x      = rms_norm(h_e) * norm_e              (norm_e: its own norm weight, initialised to the final norm's)
    x'     = x + up_e(down_e(x))                 (a rank-r residual; up_e starts at zero)
    logits = lm_head[draft vocabulary] @ x'      (the draft's own head rows, frozen and shared by every exit)

Each exit but the last also has an *exit probe*: a logistic regression on x' that predicts whether this exit's
top-1 token equals the draft's last layer's. The `probe:T` exit rule stops where the probe says so, and so runs
the LM head once per draft token, at the exit it stops at; the top-1 rules run the head at every exit they pass
(each head is about two layers' worth of the 0.5B's bytes).

At initialisation every exit equals the bare exit. Only norm_e, down_e and up_e train (2·r·D + D numbers per
exit: about 115 k for r = 64 on the 0.5B), so the adapters ship inside the package (specdraft/assets/sorted/)
and users get the trained sorted draft without training. Training: train/sorted_train.py.

Files: `adapters.json` (config) and `adapters.safetensors` (norm [E, D], down [E, r, D], up [E, D, r],
probe [E, D], probe_bias [E]; adapters saved before probes existed have no probe tensors and `probes` false).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import SpecdraftError
from ..models.native.gguf_weights import take_rows

FORMAT = "specdraft-exit-adapters-1"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "sorted"


@dataclass
class AdapterConfig:
    draft: str  # the draft model's name as loaded (identity is checked by `fingerprint`)
    fingerprint: str  # of the draft's weights (draft_fingerprint): adapters refuse another model
    exits: tuple[int, ...]  # layer counts, ascending
    rank: int
    hidden_size: int
    draft_vocab: int  # the head rows trained against: ids below this, plus special tokens (drafters/vocab.py)
    eps: float
    probes: bool = False  # whether the exit probes were trained (older adapters have none)
    extra: dict = field(default_factory=dict)  # training settings and results

    @classmethod
    def from_dict(cls, raw: dict) -> AdapterConfig:
        raw = {k: v for k, v in raw.items() if k != "format"}
        raw["exits"] = tuple(raw["exits"])
        return cls(**raw)


def draft_fingerprint(final_norm: torch.Tensor, lm_head: torch.Tensor) -> str:
    """SHA-256 of the final norm, the first LM-head rows and the vocabulary size, rounded to bf16 first (the same
    model loaded in float32 or bfloat16 has the same fingerprint)."""
    def data(t: torch.Tensor) -> bytes:
        return t.detach().to(torch.bfloat16).float().contiguous().numpy().tobytes()

    first_rows = take_rows(lm_head, torch.arange(min(16, lm_head.shape[0])))  # a GGUF head's rows dequantized: the packaged fp32 values
    return hashlib.sha256(data(final_norm) + data(first_rows) + str(lm_head.shape[0]).encode()).hexdigest()[:16]


class ExitAdapters(torch.nn.Module):
    def __init__(self, config: AdapterConfig, final_norm: torch.Tensor | None = None, seed: int = 0):
        super().__init__()
        self.config = config
        n_exits, d, r = len(config.exits), config.hidden_size, config.rank
        generator = torch.Generator().manual_seed(seed)
        start_norm = final_norm.detach().float() if final_norm is not None else torch.ones(d)
        self.norm = torch.nn.Parameter(start_norm.repeat(n_exits, 1))  # [E, D]
        self.down = torch.nn.Parameter(torch.randn(n_exits, r, d, generator=generator) / d ** 0.5)  # [E, r, D]
        self.up = torch.nn.Parameter(torch.zeros(n_exits, d, r))  # [E, D, r]: the identity at the start
        self.probe = torch.nn.Parameter(torch.zeros(n_exits, d))  # [E, D]
        self.probe_bias = torch.nn.Parameter(torch.zeros(n_exits))  # [E]

    def exit_index(self, depth: int) -> int:
        if depth not in self.config.exits:
            raise SpecdraftError(f"the sorted draft {self.config.draft!r} has trained exits at "
                                 f"{','.join(map(str, self.config.exits))}, not at {depth}")
        return self.config.exits.index(depth)

    def adapt_normed(self, normed: torch.Tensor, index: int) -> torch.Tensor:
        """normed [T, D] (rms-normalised with exit `index`'s norm weight) -> the row the LM head reads."""
        return normed + (normed @ self.down[index].T) @ self.up[index].T

    def probe_logit(self, adapted: torch.Tensor, index: int) -> torch.Tensor:
        """adapted [T, D] (what the head reads at exit `index`) -> [T]: the log-odds that this exit's top-1 token
        is the draft's last layer's."""
        return adapted @ self.probe[index] + self.probe_bias[index]

    def forward(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """hidden [T, D], the residual stream after exits[index] layers -> [T, D] for the LM head (training:
        differentiable; the drafter uses the native norm kernel and `adapt_normed`)."""
        variance = hidden.pow(2).mean(-1, keepdim=True)
        normed = hidden * torch.rsqrt(variance + self.config.eps) * self.norm[index]
        return self.adapt_normed(normed, index)


def adapters_root() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser() / "sorted"


def save_adapters(adapters: ExitAdapters, folder: str | Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().float().contiguous() for name, t in adapters.state_dict().items()}
    save_file(tensors, str(folder / "adapters.safetensors"))
    (folder / "adapters.json").write_text(json.dumps({"format": FORMAT, **asdict(adapters.config)}, indent=1) + "\n")
    return folder


def _candidates() -> list[Path]:
    roots = [ASSETS, adapters_root()]
    return [p for root in roots if root.is_dir() for p in sorted(root.iterdir()) if (p / "adapters.json").is_file()]


def resolve_adapters(name_or_path: str) -> Path:
    """A folder, or a name among the shipped adapters (specdraft/assets/sorted) and ~/.cache/specdraft/sorted."""
    path = Path(name_or_path).expanduser()
    if (path / "adapters.json").is_file():
        return path
    for candidate in _candidates():
        if candidate.name == name_or_path:
            return candidate
    known = ", ".join(p.name for p in _candidates()) or "none"
    raise SpecdraftError(f"no sorted draft {name_or_path!r}: not an adapter folder and not a known name (known: "
                         f"{known}); train one with `specdraft train sorted --out NAME`")


def load_adapters(name_or_path: str, final_norm: torch.Tensor, lm_head: torch.Tensor) -> ExitAdapters:
    """Load adapters for the draft whose final norm and LM head are given; refuses another model's."""
    from safetensors.torch import load_file

    folder = resolve_adapters(name_or_path)
    config = AdapterConfig.from_dict(json.loads((folder / "adapters.json").read_text()))
    fingerprint = draft_fingerprint(final_norm, lm_head)
    if config.fingerprint != fingerprint:
        raise SpecdraftError(f"sorted draft {folder.name!r} was trained on {config.draft!r}, a different model than "
                             f"this draft (weights fingerprint {config.fingerprint} vs {fingerprint}); pass the "
                             f"draft it was trained on (--draft) or --sorted-draft none")
    adapters = ExitAdapters(config)
    result = adapters.load_state_dict(load_file(str(folder / "adapters.safetensors")), strict=False)
    may_lack = set() if config.probes else {"probe", "probe_bias"}  # saved before probes existed
    if result.unexpected_keys or set(result.missing_keys) - may_lack:
        raise SpecdraftError(f"{folder / 'adapters.safetensors'} does not match its adapters.json (missing "
                             f"{sorted(set(result.missing_keys) - may_lack)}, unexpected {result.unexpected_keys})")
    adapters.requires_grad_(False)
    return adapters


def find_shipped(final_norm: torch.Tensor, lm_head: torch.Tensor) -> str | None:
    """The first known adapters trained for this draft (by fingerprint), or None."""
    fingerprint = draft_fingerprint(final_norm, lm_head)
    for candidate in _candidates():
        raw = json.loads((candidate / "adapters.json").read_text())
        if raw.get("fingerprint") == fingerprint:
            return str(candidate)
    return None
