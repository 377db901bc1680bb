"""An EAGLE-3-style draft head: one decoder layer that reads the target's own hidden states.

Per position i of the sequence, the head's input is
    hidden_i  : fc([h_low, h_mid, h_high]_i)   (3 target layers fused, linear 3D_t -> D; no bias)
                or, after the first draft step, the head's own output at the previous step
    embed_i   : the target's embedding of the token *after* position i (frozen, shared with the target)
and it computes, as a Llama decoder layer whose attention reads both (q/k/v from 2D inputs):
    x    = [input_layernorm(embed_i), hidden_norm(hidden_i)]       [2D]
    h    = hidden_i + o_proj(attention(x))                          (residual: the un-normed hidden)
    out  = h + mlp(post_attention_layernorm(h))                     -> fed back as the next step's hidden
    logits over the reduced draft vocabulary = lm_head(norm(out))   [V_draft]
The draft vocabulary is a subset of the target's: `d2t[j]` is the target id of draft id j; `t2d` marks the
target ids that have a draft id. Parameter names follow the EAGLE-3 checkpoint layout (`fc`, `midlayer.*`,
`norm`, `lm_head`) so export is a renaming of nothing (see `export_eagle3`).

The head's KV cache (`HeadCache`) holds one row per sequence position, at the same positions as the target.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from ..errors import SpecdraftError
from ..models.native.gguf_weights import take_rows

HEAD_FORMAT = "specdraft-eagle-head-1"


@dataclass
class EagleHeadConfig:
    """Shapes of the head and the identity of the target it was trained for."""

    target: str  # the target's name as loaded (packaged name, path or hub id)
    target_hidden_size: int
    vocab_size: int  # the target's logits width
    vocab_hash: str  # SHA-256 of the target tokenizer's vocabulary (`vocab_hash` below)
    target_layers: list[int]  # the 3 taps (Hugging Face hidden_states indexing: i = input of layer i)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target_n_layers: int = 0
    extra: dict = field(default_factory=dict)  # training provenance (data, steps), kept in the saved config

    @classmethod
    def from_dict(cls, d: dict) -> EagleHeadConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, linear=None) -> torch.Tensor:
        """x [T, D] -> [T, D]; `linear(module, x)` applies one of the matrices (default: the module itself)."""
        linear = linear or (lambda module, rows: module(rows))
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class _MidLayer(nn.Module):
    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the fused / previous hidden state
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class HeadCache:
    """Keys and values of the head's layer: [kv_heads, capacity, head_dim] each; rollback = length change."""

    def __init__(self, config: EagleHeadConfig, capacity: int = 256):
        shape = (config.num_key_value_heads, capacity, config.head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [kv_heads, T, head_dim] at positions length .. length + T - 1."""
        end = self.length + keys.shape[1]
        if end > self.keys.shape[1]:
            capacity = max(end, 2 * self.keys.shape[1])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.keys[:, self.length:end] = keys
        self.values[:, self.length:end] = values
        self.length = end

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class EagleHead(nn.Module):
    """The head's parameters and its two computations: a cached inference step and the pieces training unrolls.

    `embed` is the target's input embedding [V, D], used frozen (it is not a parameter of the head)."""

    def __init__(self, config: EagleHeadConfig, embed: torch.Tensor):
        super().__init__()
        c = self.config = config
        if embed.shape != (c.vocab_size, c.hidden_size) and embed.shape[1] != c.hidden_size:
            raise SpecdraftError(f"the target's embedding {tuple(embed.shape)} does not fit a head of hidden size "
                                 f"{c.hidden_size}")
        self.embed = embed  # [V, D] in the target's dtype, frozen, not registered (rows are widened when read)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # draft id -> target id
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))  # target id has a draft id
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dh / 2]
        # set by use_native_bf16: the native kernels and bf16 copies of the matrices (by id of the nn.Linear) that
        # inference reads; empty: no copies
        self._native_ops = None
        self._native_weights: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ shared pieces
    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] by one of the head's matrices: its parameter (training, or no native kernels),
        or at inference after `use_native_bf16` a bf16 copy through the native kernel."""
        # copies made at the call: a head in training mode (its parameters moving) reads its parameters
        native = None if self.training else self._native_weights.get(id(module))
        if native is None:
            return module(x)
        return self._native_ops.linear(x.float().contiguous(), native, None)

    def use_native_bf16(self, ops) -> None:
        """Draft with bf16 copies of the head's matrices through the native kernels `ops` (load_kernels()).

        Why: the head's matrices are fp32 for training, and torch's fp32 products of a few rows are slow here
        (the 8,192 x 1,536 LM head: 3.7 ms for 1 row, 8.4 for 4; native bf16 0.46 / 0.45 ms). Drafting stays
        exact for the engine either way: greedy checks the target's own choice, sampling uses the q it drew.
        The parameters are untouched (training reads them), the copies live beside them."""
        self._native_ops = ops
        self._native_weights = {id(m): m.weight.detach().to(torch.bfloat16).contiguous()
                                for m in self.modules() if isinstance(m, nn.Linear)}

    def step_bytes(self) -> int:
        """Weight bytes one inference step reads: each matrix's bf16 copy where `use_native_bf16` made one (gamma
        auto prices a draft token by them), the norms; not the embedding rows (one row per token)."""
        total = 0
        for module in self.modules():
            if isinstance(module, nn.Linear):
                weight = self._native_weights.get(id(module), module.weight)
                total += weight.numel() * weight.element_size()
            elif isinstance(module, RMSNorm):
                total += module.weight.numel() * module.weight.element_size()
        return total

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target: [V_draft] int64, the target id of each draft id (ascending)."""
        self.d2t.copy_(draft_to_target)
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [T, 3, D_t] (the target's hidden states at the three layers) -> [T, D]."""
        return self.linear(self.fc, taps.reshape(taps.shape[0], -1).to(self.fc.weight.dtype))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, Dh] rotated by positions [T] (the half-split convention of Llama)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh / 2]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def qkv(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """hidden [T, D], next_ids [T] (the token after each position), positions [T] ->
        q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh] (q and k rotated)."""
        c, layer = self.config, self.midlayer
        embeds = take_rows(self.embed, next_ids).to(hidden.dtype)  # [T, D]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [T, 2D]
        attn = layer.self_attn
        q = self.linear(attn.q_proj, x).view(-1, c.num_attention_heads, c.head_dim)
        k = self.linear(attn.k_proj, x).view(-1, c.num_key_value_heads, c.head_dim)
        v = self.linear(attn.v_proj, x).view(-1, c.num_key_value_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (the residual), attended [T, H * Dh] -> the layer's output [T, D] (pre-norm)."""
        layer = self.midlayer
        h = hidden + self.linear(layer.self_attn.o_proj, attended)
        return h + layer.mlp(layer.post_attention_layernorm(h), self.linear)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, D] -> logits over the draft vocabulary [T, V_draft]."""
        return self.linear(self.lm_head, self.norm(out))

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[T, V_draft] -> [T, V] float32, -inf outside the draft vocabulary (so its probabilities are 0 there)."""
        full = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.d2t] = draft_logits
        return full.float()

    # ------------------------------------------------------------------ inference
    def step(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: HeadCache,
             positions: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Append T rows to the cache. hidden [T, D] (fused taps or the previous output), next_ids [T].
        positions [T] default to the rows' cache slots; visible [T, cache.length + T] bool says which cached
        rows each new row attends to (default causal: everything cached and the new rows up to itself; a tree
        passes its ancestors). Returns the layer output [T, D] (the next step's hidden; `draft_logits` reads it)."""
        c = self.config
        n_new = hidden.shape[0]
        start = cache.length
        if positions is None:
            positions = torch.arange(start, start + n_new)
        if visible is None:
            visible = torch.arange(start + n_new)[None, :] <= torch.arange(start, start + n_new)[:, None]  # [T, L]
        q, k, v = self.qkv(hidden, next_ids, positions)
        cache.append(k.transpose(0, 1), v.transpose(0, 1))
        group = c.num_attention_heads // c.num_key_value_heads
        keys = cache.keys[:, : cache.length].repeat_interleave(group, 0)  # [H, L, Dh]
        values = cache.values[:, : cache.length].repeat_interleave(group, 0)
        attended = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible)  # [H, T, Dh]
        return self.finish(hidden, attended.transpose(0, 1).reshape(n_new, -1))


def new_head(config: EagleHeadConfig, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor,
             draft_to_target: torch.Tensor, seed: int = 0) -> EagleHead:
    """A fresh head for a target whose input embedding [V, D], LM head [V, D] and final norm [D] are given:
    random layer; LM head rows and final norm copied from the target's (the head's output then lives in the
    target's residual space from the start)."""
    generator = torch.Generator().manual_seed(seed)
    head = EagleHead(config, embed.detach().float())
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
        head.set_vocab(draft_to_target)
        head.lm_head.weight.copy_(lm_head.detach().float()[draft_to_target])
        head.norm.weight.copy_(final_norm.detach().float())
    return head


def head_config_for(target_name: str, hf_config, vocab_size: int, layers: tuple[int, ...], draft_vocab_size: int,
                    vocab_hash: str, intermediate_size: int | None = None) -> EagleHeadConfig:
    """A head shaped like one decoder layer of the target whose Hugging Face config is `hf_config`."""
    tc = hf_config
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = float(theta or getattr(tc, "rope_theta", None) or 10000.0)
    return EagleHeadConfig(
        target=target_name, target_hidden_size=tc.hidden_size, vocab_size=vocab_size, vocab_hash=vocab_hash,
        target_layers=list(layers), hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        draft_vocab_size=min(draft_vocab_size, vocab_size), rms_norm_eps=float(tc.rms_norm_eps),
        rope_theta=theta, max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
        target_n_layers=int(tc.num_hidden_layers))


# ---------------------------------------------------------------------------------------------- save / load

def heads_root() -> Path:
    import os

    return Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser() / "heads"


def save_head(head: EagleHead, folder: str | Path) -> Path:
    """Our own format: head.json (config) + head.safetensors (parameters and vocabulary maps)."""
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "head.json").write_text(json.dumps({"format": HEAD_FORMAT, **asdict(head.config)}, indent=1))
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(folder / "head.safetensors"))
    return folder


def resolve_head_path(name_or_path: str) -> Path:
    """A folder path, or a name under ~/.cache/specdraft/heads/ (or $SPECDRAFT_CACHE/heads)."""
    path = Path(name_or_path).expanduser()
    for candidate in (path, heads_root() / name_or_path):
        if candidate.is_dir() and ((candidate / "head.json").is_file() or (candidate / "config.json").is_file()):
            return candidate
    known = sorted(p.name for p in heads_root().glob("*") if p.is_dir()) if heads_root().is_dir() else []
    raise SpecdraftError(f"no EAGLE head {name_or_path!r}: not a head folder and not a trained head in "
                         f"{heads_root()} (known: {', '.join(known) or 'none'}); train one with "
                         f"`specdraft train eagle --out NAME`")


def read_head(name_or_path: str) -> tuple[EagleHeadConfig, dict[str, torch.Tensor]]:
    """A head's config and tensors (ours, or an EAGLE-3 export), unchecked: `load_head` checks them against a
    loaded target, the trainer (`--init`) against its features."""
    from safetensors.torch import load_file

    folder = resolve_head_path(name_or_path)
    try:
        if (folder / "head.json").is_file():
            return (EagleHeadConfig.from_dict(json.loads((folder / "head.json").read_text())),
                    load_file(str(folder / "head.safetensors")))
        return read_eagle3(folder)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        # a missing or cut-off file, or a config without the fields (json's errors are ValueErrors)
        raise SpecdraftError(f"EAGLE head {name_or_path!r} ({folder}) could not be read: {type(error).__name__}: "
                             f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}; train or "
                             "export it again") from error


def target_mismatches(config: EagleHeadConfig, hidden_size: int, vocab_size: int, tokenizer_hash: str) -> list[str]:
    """What keeps a head from serving a target of these shapes and tokenizer vocabulary (an EAGLE-3 export holds
    no vocabulary hash: its width must match)."""
    problems = []
    if config.target_hidden_size != hidden_size:
        problems.append(f"hidden size {config.target_hidden_size} vs the target's {hidden_size}")
    if config.vocab_size != vocab_size:
        problems.append(f"vocabulary of {config.vocab_size} vs the target's {vocab_size}")
    elif config.vocab_hash and config.vocab_hash != tokenizer_hash:
        problems.append("a different tokenizer vocabulary")
    return problems


def vocab_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's (token, id) pairs: a head trained for one vocabulary refuses another."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def load_head(name_or_path: str, target) -> EagleHead:
    """Load a head (ours, or an EAGLE-3 export) for `target` (a LoadedModel); refuses a head trained for
    another target (hidden size, vocabulary)."""
    config, tensors = read_head(name_or_path)
    problems = target_mismatches(config, target.hidden_size, target.vocab_size, vocab_hash(target.tokenizer))
    if max(config.target_layers) > target.n_layers:
        problems.append(f"taps at layers {config.target_layers} but the target has {target.n_layers}")
    if problems:
        raise SpecdraftError(f"EAGLE head {name_or_path!r} was trained for {config.target!r}, not for "
                             f"{target.name!r} ({'; '.join(problems)}); train a head for this target")
    # the target's own matrix, no copy (the native one: a GGUF target's embedding stays in its block format)
    embed = target.native.embed if target.native is not None else target.model.get_input_embeddings().weight.detach()
    head = head_from_tensors(config, tensors, embed, f"EAGLE head {name_or_path!r}")
    head.eval()
    return head


def head_from_tensors(config: EagleHeadConfig, tensors: dict[str, torch.Tensor], embed: torch.Tensor,
                      what: str) -> EagleHead:
    """The head `read_head` gave, on the target's input embedding [V, D]; `what` names it in the error."""
    head = EagleHead(config, embed)
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise SpecdraftError(f"{what} is incomplete or not a head (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]})")
    return head


# ---------------------------------------------------------------------------------------------- EAGLE-3 layout

def export_eagle3(head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head in the EAGLE-3 checkpoint layout that vLLM's `LlamaForCausalLMEagle3` and SGLang's
    `LlamaForCausalLMEagle3` load: config.json (a one-layer Llama config plus `draft_vocab_size`,
    `target_hidden_size`, `eagle_config`) and model.safetensors with `fc.weight`, `midlayer.*`, `norm.weight`,
    `lm_head.weight`, `d2t` (int64 offsets: target id = draft id + d2t[draft id]) and `t2d` (bool [V]).
    The embedding is not written: both loaders share the target's when the checkpoint has none."""
    from safetensors.torch import save_file

    c = head.config
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(c.target_layers),
        "specdraft": {"format": HEAD_FORMAT, "target": c.target, "vocab_hash": c.vocab_hash,
                      "target_n_layers": c.target_n_layers, "extra": c.extra},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in head.state_dict().items()
               if name not in ("d2t", "t2d")}
    tensors["d2t"] = (head.d2t - torch.arange(c.draft_vocab_size)).contiguous()  # offsets, as the loaders add
    tensors["t2d"] = head.t2d.clone()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def read_eagle3(folder: str | Path) -> tuple[EagleHeadConfig, dict[str, torch.Tensor]]:
    """Read an EAGLE-3 checkpoint folder back into our config and state dict (float32)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if "LlamaForCausalLMEagle3" not in raw.get("architectures", []):
        raise SpecdraftError(f"{folder} is not an EAGLE-3 checkpoint (architectures {raw.get('architectures')})")
    ours = raw.get("specdraft", {})
    layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or raw.get(
        "eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise SpecdraftError(f"{folder}/config.json does not say which target layers the head reads "
                             f"(eagle_aux_hidden_state_layer_ids)")
    config = EagleHeadConfig(
        target=ours.get("target", "unknown"), target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
        vocab_size=raw["vocab_size"], vocab_hash=ours.get("vocab_hash", ""), target_layers=list(layers),
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"], rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw.get("rope_theta", 10000.0), max_position_embeddings=raw.get("max_position_embeddings", 32768),
        target_n_layers=ours.get("target_n_layers", 0), extra=ours.get("extra", {}))
    tensors = {name: (t.float() if t.is_floating_point() else t) for name, t in load_file(
        str(folder / "model.safetensors")).items()}
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].long() + torch.arange(config.draft_vocab_size)
    else:
        tensors["d2t"] = torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[tensors["d2t"]] = True
    tensors["t2d"] = t2d
    return config, tensors
