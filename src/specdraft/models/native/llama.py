"""A native forward for the Llama/Qwen2/Qwen3/Mistral/SmolLM3/Phi-3 and Gemma 2/3 family, over the weights of a loaded
Hugging Face model or of a GGUF file.

Why: the generic transformers forward is correct for every causal LM but computes a k-token verify pass
with different kernels than a 1-token decode step, so the two round differently (and cost 2-3x more for
2-16 rows on this CPU). Here every matrix product, norm and attention row goes through `kernels.cpp`, whose
results do not depend on how many tokens a pass holds: verify == decode bit for bit, in float32 and in
bfloat16 weights alike. Activations and the KV cache are float32; float weights stay in the model's dtype and are
shared with the Hugging Face model (no copy); a GGUF's matrices stay in its block formats (gguf_weights.py,
quant_kernels.cpp), with no transformers model at all.

The cache is preallocated ([layers, kv_heads, capacity, head_dim] per K and V) and grows by doubling;
rolling back is a change of length.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ...errors import SpecdraftError
from .gguf_weights import GGUFTensors, PanelWeight, QuantWeight, stored_bytes, take_rows, unpermute_rows
from .kernels import load_kernels, unavailable_reason

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "gemma2", "gemma3_text")
# Gemma's layers: norms of (1 + weight), the attention's and the MLP's outputs normed before the residual, a gelu
# gate, embeddings scaled by sqrt(hidden), local layers with a sliding window (and in Gemma 3 their own RoPE)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# inverse frequencies fixed at load time; "longrope" (Phi-3.5, Phi-4-mini): its short factors, which transformers
# uses up to `original_max_position_embeddings` positions (a forward past them turns every position by the long ones,
# and its generate recomputes the cache there), so the native context stops there (`native_positions`)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# float32 passes longer than this (prompt prefill) use torch's matmul: faster for many rows, and batch
# invariance matters only between verify passes and decode steps, which are all far shorter. bf16 weights
# always use the kernels: widening 3 GB of weights per call costs more than the matmul saves (a 37-token
# prefill of the 1.5B: 3.3 s with the kernels, 11-13 s widened + MKL, one core).
MAX_KERNEL_ROWS = 32


def _rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters; Gemma 3's are per layer type ("full_attention", "sliding_attention")."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        return parameters[layer_type]
    return parameters


def config_unsupported_reason(config) -> str | None:
    """Why a model of this Hugging Face config cannot run natively (None when it can), whatever its weights."""
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not in the native family ({', '.join(SUPPORTED_MODEL_TYPES)})"
    gemma = model_type in GEMMA_MODEL_TYPES
    activation = getattr(config, "hidden_activation", None) if gemma else getattr(config, "hidden_act", "silu")
    if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
        return f"activation {activation!r} (native supports silu, and gelu_pytorch_tanh in Gemma)"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    for layer_type in sorted(layer_types):
        rope = _rope_parameters(config, layer_type)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} (native supports {', '.join(STATIC_ROPE_TYPES)})"
    # Gemma's window on its local layers; SmolLM3's on its sliding layers, where `use_sliding_window` turns it on
    if (gemma or model_type == "smollm3") and not layer_types <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)}"
    if gemma:
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention (an embedding model)"
        if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
            return "sliding-window layers without a window"
    elif model_type in ("qwen2", "qwen3"):  # Qwen's window where `use_sliding_window` turns it on
        if not layer_types <= {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(layer_types)}"
        if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
            return "sliding-window layers without a window"
    elif model_type == "llama" and layer_types != {"full_attention"}:  # (transformers' Llama has no window)
        return "sliding-window attention layers"
    if getattr(config, "mlp_bias", False) or getattr(config, "pretraining_tp", 1) != 1:
        return "MLP biases or tensor-parallel pretraining layout"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8:
        return f"head size {head_dim} is not a multiple of 8"
    if not 0 < rotary_dim(config) <= head_dim or rotary_dim(config) % 2:
        return f"a rotary embedding over {rotary_dim(config)} of a head's {head_dim} dims"
    return unavailable_reason()


def rotary_dim(config) -> int:
    """How many of a head's dims the rotary embedding turns (Phi-4-mini's partial_rotary_factor 0.75: the first 96
    of 128), as transformers computes it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * (_rope_parameters(config).get("partial_rotary_factor") or 1.0))


def rotary_row_order(head_dim: int, rotated: int) -> torch.Tensor | None:
    """The kernels turn each head's dims i and i + Dh/2 together. transformers' partial rotary embedding (Phi-3)
    turns dims i and i + r/2 of the first r and leaves the rest as they are; the q and k projections' rows, reordered
    within each head by this order [Dh] (row m of ours is row order[m] of theirs), put its pairs where the kernels
    turn them and its unturned dims on pairs whose angle is 0 (`_cover_positions`). q.k is the same sum of the same
    products. None where every dim turns."""
    if rotated == head_dim:
        return None
    half, pairs = head_dim // 2, rotated // 2
    unturned = torch.arange(rotated, head_dim)
    return torch.cat([torch.arange(pairs), unturned[: half - pairs], torch.arange(pairs, rotated),
                      unturned[half - pairs:]])


def reorder_head_rows(weight, n_heads: int, order: torch.Tensor | None):
    """A q or k projection's rows (or its bias) with each head's rows in `order` (`rotary_row_order`)."""
    if weight is None or order is None:
        return weight
    head_dim = order.numel()
    rows = (torch.arange(n_heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    if isinstance(weight, QuantWeight):
        return QuantWeight(weight.rows_layout(rows).contiguous(), weight.qtype, weight.cols)
    return weight[rows].contiguous()


def native_positions(config) -> int:
    """The positions the native forward serves: the config's, but a long-RoPE model's only up to
    `original_max_position_embeddings` (see STATIC_ROPE_TYPES)."""
    limit = int(getattr(config, "max_position_embeddings", None) or 4096)
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type")) == "longrope":
        original = (rope.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", None))
        limit = min(limit, int(original)) if original else limit
    return limit


def native_unsupported_reason(hf_model) -> str | None:
    """Why this loaded model cannot run natively (None when it can)."""
    dtype = next(hf_model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"native weights must be float32 or bfloat16, not {dtype}"
    return config_unsupported_reason(hf_model.config)


ROTARY_ROWS = 1024  # rotary positions tabulated at load; more on first use
# a float32/bfloat16/float16 matrix, the same in panels (a GGUF's dense matrices, a folder's bf16 ones), or one in
# a GGUF block format
Weight = torch.Tensor | PanelWeight | QuantWeight


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [D] float32
    q: Weight  # [H * Dh, D]
    q_bias: torch.Tensor | None
    k: Weight  # [Hkv * Dh, D]
    k_bias: torch.Tensor | None
    v: Weight  # [Hkv * Dh, D]
    v_bias: torch.Tensor | None
    o: Weight  # [D, H * Dh]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [D] float32
    gate: Weight  # [I, D]
    up: Weight  # [I, D]
    down: Weight  # [D, I]
    q_norm: torch.Tensor | None = None  # [Dh] float32: Qwen3's RMSNorm of each head's q, before the rotary embedding
    k_norm: torch.Tensor | None = None  # [Dh] float32: the same for k
    attention_output_norm: torch.Tensor | None = None  # [D] float32: Gemma's norm of o's output, before the residual
    mlp_output_norm: torch.Tensor | None = None  # [D] float32: Gemma's norm of down's output, before the residual


@dataclass(frozen=True)
class Variant:
    """What a model type changes in the shared decoder layer; the defaults are Llama/Qwen2/Qwen3/Mistral's."""

    gelu: bool = False  # the MLP gates by gelu in its tanh form instead of silu
    embed_scale: float = 1.0  # what the embeddings are multiplied by (Gemma: sqrt(hidden size))
    attention_scale: float = 0.0  # what q.k is multiplied by (0: 1 / sqrt(head size))
    attention_softcap: float = 0.0  # Gemma 2: scores capped as cap tanh(score / cap) (0: none)
    final_softcap: float = 0.0  # Gemma 2: the logits capped the same way (0: none)
    windows: tuple[int, ...] = ()  # per layer: a sliding window over this many positions (0: every position)
    rope_tables: tuple[int, ...] = ()  # per layer: which of `_rotary_layer_types(config)` it rotates by


NO_ROPE = "no_rope"  # the rotary "table" of SmolLM3's NoPE layers: every angle 0, a rotation that changes no bit


def _rotary_layer_types(config) -> list[str | None]:
    """The layer types with rotary tables of their own: Gemma 3's full and sliding layers ([full, sliding]);
    SmolLM3's layers with and without RoPE ([None, NO_ROPE]); one table ([None]) for every other model."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and isinstance(parameters.get("sliding_attention"), dict):
        return ["full_attention", "sliding_attention"]
    if not all(getattr(config, "no_rope_layers", None) or [1]):
        return [None, NO_ROPE]
    return [None]


def _no_rotation(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of 0: cos 1 and sin 0 at every position, so x cos - y sin is x exactly."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return torch.zeros(dim // 2), 1.0


def model_variant(config, embed_dtype: torch.dtype = torch.float32) -> Variant:
    """The `Variant` of a (supported) config. embed_dtype: the embedding's dtype, in which transformers rounds
    Gemma's scale (sqrt(1152) = 33.94 is 34.0 in bfloat16; llama.cpp multiplies by the float32 root)."""
    n_layers = config.num_hidden_layers
    if config.model_type == "smollm3":  # NoPE layers; a window on the sliding layers where it is turned on
        window = int(config.sliding_window or 0) if getattr(config, "use_sliding_window", False) else 0
        return Variant(windows=tuple(window if kind == "sliding_attention" else 0 for kind in config.layer_types),
                       rope_tables=tuple(0 if rope else _rotary_layer_types(config).index(NO_ROPE)
                                         for rope in config.no_rope_layers))
    if config.model_type not in GEMMA_MODEL_TYPES:
        window = int(getattr(config, "sliding_window", None) or 0)
        if config.model_type in ("mistral", "phi3"):  # their window, where set, on every layer
            return Variant(windows=(window,) * n_layers, rope_tables=(0,) * n_layers)
        # Qwen's on its sliding layers (`use_sliding_window`: those from `max_window_layers` on); Llama's: none
        qwen = config.model_type in ("qwen2", "qwen3")
        kinds = (getattr(config, "layer_types", None) if qwen else None) or ["full_attention"] * n_layers
        return Variant(windows=tuple(window if kind == "sliding_attention" else 0 for kind in kinds),
                       rope_tables=(0,) * n_layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    table_types = _rotary_layer_types(config)
    return Variant(
        gelu=True, embed_scale=float(torch.tensor(config.hidden_size ** 0.5).to(embed_dtype)),
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attention_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        windows=tuple(int(config.sliding_window) if kind == "sliding_attention" else 0 for kind in layer_types),
        rope_tables=tuple(table_types.index(kind) if kind in table_types else 0 for kind in layer_types))


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().contiguous()


def _norm_weight(norm: torch.nn.Module | None, offset: float) -> torch.Tensor | None:
    """An RMSNorm's weight as the kernels multiply by it: float32, plus 1 for Gemma's (which multiply by 1 + weight,
    the sum in float32, as llama.cpp's converter stores them). None for a model without that norm."""
    return None if norm is None else (norm.weight.detach().float() + offset).contiguous()


def _head_norm(weight: torch.Tensor | None, order: torch.Tensor | None) -> torch.Tensor | None:
    """A per-head norm's weight [Dh] in the heads' row order (`rotary_row_order`)."""
    return weight if weight is None or order is None else weight[order].contiguous()


def _module_rotary(rotary: torch.nn.Module, layer_type: str | None, config) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention scaling a transformers rotary module holds (for Gemma 3, per layer
    type). A table it does not hold comes from the config: SmolLM3's no rotation, or Gemma 3's full table when all
    its layers are local (transformers keeps tables only for the kinds present; no layer uses that one)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    if not hasattr(rotary, f"{prefix}inv_freq"):
        return rotary_frequencies(config, layer_type)
    return getattr(rotary, f"{prefix}inv_freq"), float(getattr(rotary, f"{prefix}attention_scaling", 1.0))


def rotary_frequencies(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [Dh / 2] and attention scaling that the model of transformers computes for `config`
    (its RotaryEmbedding's; Gemma 3's for `layer_type`), without importing the model's code: the default RoPE by the
    same float32 operations, any other type (linear, dynamic, yarn, llama3, ...) by transformers' own function."""
    if layer_type == NO_ROPE:
        return _no_rotation(config)
    parameters = _rope_parameters(config, layer_type)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, **extra)
        return inv_freq, float(scaling)
    return default_rotary_frequencies(config, layer_type), 1.0


def default_rotary_frequencies(config, layer_type: str | None = None) -> torch.Tensor:
    """The unscaled RoPE's inverse frequencies [r / 2] (r: `rotary_dim`), by transformers' float32 operations."""
    base = _rope_parameters(config, layer_type)["rope_theta"]
    dim = rotary_dim(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def gguf_rotary_frequencies(weights: GGUFTensors, config) -> tuple[torch.Tensor, float]:
    """`rotary_frequencies` for a GGUF file. llama.cpp's converter writes a Llama 3 RoPE (rope type llama3) as a
    tensor, `rope_freqs.weight` [Dh / 2]: each frequency is the unscaled one divided by its factor there.
    transformers' reading of such a file keeps no RoPE scaling in the config, so the file's factors decide."""
    layer_type = _rotary_layer_types(config)[0]
    factors = weights.get("rope_freqs.weight")
    if factors is None:
        return rotary_frequencies(config, layer_type)
    inv_freq = default_rotary_frequencies(config, layer_type)
    if isinstance(factors, QuantWeight) or factors.numel() != inv_freq.numel():
        raise SpecdraftError(f"{weights.path.name}: rope_freqs.weight holds {tuple(factors.shape)}, not the "
                             f"{inv_freq.numel()} factors of heads of {2 * inv_freq.numel()}")
    return inv_freq / factors.float().reshape(-1), 1.0


class NativeLlama:
    """Forward passes of a Llama/Qwen2/Qwen3/Mistral or Gemma 2/3 model over a `NativeCache`."""

    def __init__(self, hf_model, panels: bool = False):
        """The native forward over an already loaded Hugging Face model's weights (shared, not copied). With
        `panels`, its bfloat16 layer matrices are repacked in panels instead (`PanelWeight`, where the build has
        them), each taken from the Hugging Face model as it is repacked (its linear's weight becomes None): that
        model is spent, and `transformers_spent` says so. float32 matrices stay shared (long passes take torch's
        matmul)."""
        reason = native_unsupported_reason(hf_model)
        if reason:
            raise ValueError(reason)
        base = hf_model.model
        self.transformers_spent = False

        def matrices(linear: torch.nn.Linear, rows: list[int] | None = None,
                     orders: tuple[torch.Tensor | None, ...] = (None,)) -> list[Weight]:
            """The linear's weight, or its blocks of `rows` rows (Phi-3's fused q/k/v and gate/up), the i-th with
            each head's rows in orders[i] (`rotary_row_order`; a copy then)."""
            weight = linear.weight.detach()
            pieces = [weight] if rows is None else list(weight.split(rows))
            pieces = [piece if order is None else reorder_head_rows(piece, len(piece) // len(order), order)
                      for piece, order in zip(pieces, orders, strict=True)]
            if not panels or weight.dtype != torch.bfloat16:
                return pieces
            repacked = [PanelWeight.pack(piece) for piece in pieces]
            if any(packed is not piece for packed, piece in zip(repacked, pieces)):
                linear.weight = None  # the only other reference: freed now, not after the whole model is packed
                self.transformers_spent = True
            return repacked

        def matrix(linear: torch.nn.Linear, order: torch.Tensor | None = None) -> Weight:
            return matrices(linear, orders=(order,))[0]

        config = hf_model.config
        gemma = config.model_type in GEMMA_MODEL_TYPES
        offset = 1.0 if gemma else 0.0  # Gemma's norms multiply by 1 + weight
        n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        order = rotary_row_order(head_dim, rotary_dim(config))
        layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if config.model_type == "phi3":  # q, k and v in one matrix, gate and up in another
                q, k, v = matrices(attn.qkv_proj, [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim],
                                   (order, order, None))
                q_bias = k_bias = v_bias = None
                gate, up = matrices(mlp.gate_up_proj, [config.intermediate_size] * 2, (None, None))
            else:
                q, k, v = matrix(attn.q_proj, order), matrix(attn.k_proj, order), matrix(attn.v_proj)
                q_bias = reorder_head_rows(_bias(attn.q_proj), n_heads, order)
                k_bias = reorder_head_rows(_bias(attn.k_proj), n_kv_heads, order)
                v_bias = _bias(attn.v_proj)
                gate, up = matrix(mlp.gate_proj), matrix(mlp.up_proj)
            layers.append(_Layer(
                input_norm=_norm_weight(layer.input_layernorm, offset),
                q=q, q_bias=q_bias, k=k, k_bias=k_bias, v=v, v_bias=v_bias,
                o=matrix(attn.o_proj), o_bias=_bias(attn.o_proj),
                # the norm before the MLP: Gemma's pre_feedforward_layernorm (its post_attention_layernorm norms the
                # attention's output), Llama's post_attention_layernorm
                post_norm=_norm_weight(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                                       offset),
                gate=gate, up=up, down=matrix(mlp.down_proj),
                q_norm=_head_norm(_norm_weight(getattr(attn, "q_norm", None), offset), order),
                k_norm=_head_norm(_norm_weight(getattr(attn, "k_norm", None), offset), order),
                attention_output_norm=_norm_weight(layer.post_attention_layernorm, offset) if gemma else None,
                mlp_output_norm=_norm_weight(layer.post_feedforward_layernorm, offset) if gemma else None))
        embed_dtype = base.embed_tokens.weight.dtype
        self._setup(config, [_module_rotary(base.rotary_emb, kind, config) for kind in _rotary_layer_types(config)],
                    base.embed_tokens.weight.detach(), hf_model.get_output_embeddings().weight.detach(),
                    _norm_weight(base.norm, offset), layers, embed_dtype, model_variant(config, embed_dtype))

    @classmethod
    def from_gguf(cls, weights: GGUFTensors, config) -> "NativeLlama":
        """The native forward over a GGUF file's tensors (llama.cpp's names), matrices in their block formats.
        config: the model's Hugging Face config."""
        reason = config_unsupported_reason(config)
        if reason:
            raise ValueError(reason)
        native = cls.__new__(cls)
        native.transformers_spent = False
        n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        llama_order = weights.architecture == "llama"  # its converter interleaves the Q and K rows of each head

        def rows_of(name: str, heads: int) -> Weight | None:
            tensor = weights.need(name) if name.endswith(".weight") else bias(name)
            return unpermute_rows(tensor, heads) if tensor is not None and llama_order else tensor

        def bias(name: str) -> torch.Tensor | None:
            tensor = weights.get(name)
            return None if tensor is None else tensor.float().contiguous()

        def norm(name: str, optional: bool = False) -> torch.Tensor | None:  # optional: Qwen3's head norms, ...
            tensor = weights.get(name) if optional else weights.need(name)  # (Gemma's hold 1 + weight already)
            return None if tensor is None else tensor.float().contiguous()

        gemma = config.model_type in GEMMA_MODEL_TYPES

        def interleaved(weight: Weight) -> Weight:  # block formats in groups of 8 rows, dense ones in panels
            if isinstance(weight, QuantWeight):
                repacked = weight.interleave(weights)
            else:
                repacked = PanelWeight.pack(weight)
                if repacked is not weight:
                    weights.release(weight)
            for name, tensor in weights.tensors.items():  # a matrix converted at load (IQ3, IQ2 to bf16) is a
                if tensor is weight:  # copy of its own: the file's tensors let go of it, so it is freed once repacked
                    weights.tensors[name] = repacked
            return repacked

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        fused = weights.get("blk.0.attn_qkv.weight") is not None  # Phi-3's q, k and v in one matrix
        for name, heads in ((("blk.0.attn_qkv.weight", n_heads + 2 * n_kv_heads),) if fused else (
                ("blk.0.attn_q.weight", n_heads), ("blk.0.attn_k.weight", n_kv_heads))):
            rows = weights.need(name).shape[0]
            if rows != heads * head_dim:
                raise SpecdraftError(f"{weights.path.name}: {name} has {rows} rows, not the config's {heads} heads "
                                     f"of {head_dim}: the config does not describe this file")
        order = rotary_row_order(head_dim, rotary_dim(config))

        def reordered(weight: Weight | None, heads: int) -> Weight | None:
            """q's or k's rows in the kernels' order: a copy, so the file's pages under them are let go."""
            if weight is None or order is None:
                return weight
            copy = reorder_head_rows(weight, heads, order)
            weights.release(weight)
            return copy

        def attention_rows(prefix: str) -> tuple[Weight, ...]:
            """q, k, v and their biases (None where the file has none), q's and k's rows in the kernels' order."""
            if fused:  # row blocks of one matrix, which the file's tensors let go of (its storage lives while a
                qkv = weights.take(prefix + "attn_qkv.weight")  # block does: all three once repacked)
                q, k, v = (qkv[start: start + rows] for start, rows in (
                    (0, n_heads * head_dim), (n_heads * head_dim, n_kv_heads * head_dim),
                    ((n_heads + n_kv_heads) * head_dim, n_kv_heads * head_dim)))
                biases = (None, None, None)
            else:
                q, k = rows_of(prefix + "attn_q.weight", n_heads), rows_of(prefix + "attn_k.weight", n_kv_heads)
                v = weights.need(prefix + "attn_v.weight")
                biases = (rows_of(prefix + "attn_q.bias", n_heads), rows_of(prefix + "attn_k.bias", n_kv_heads),
                          bias(prefix + "attn_v.bias"))
            return (reordered(q, n_heads), reordered(biases[0], n_heads), reordered(k, n_kv_heads),
                    reordered(biases[1], n_kv_heads), v, biases[2])

        def gate_and_up(prefix: str) -> tuple[Weight, Weight]:
            if weights.get(prefix + "ffn_gate.weight") is not None:
                return weights.need(prefix + "ffn_gate.weight"), weights.need(prefix + "ffn_up.weight")
            up = weights.take(prefix + "ffn_up.weight")  # (as the fused q/k/v above)
            if up.shape[0] != 2 * config.intermediate_size:  # Phi-3: gate and up in one matrix
                raise SpecdraftError(f"{weights.path.name}: {prefix}ffn_up.weight has {up.shape[0]} rows and no "
                                     f"ffn_gate.weight beside it, not the 2 x {config.intermediate_size} of a fused "
                                     f"gate and up")
            return up[: config.intermediate_size], up[config.intermediate_size:]

        layers = []
        for i in range(config.num_hidden_layers):
            prefix = f"blk.{i}."
            q, q_bias, k, k_bias, v, v_bias = attention_rows(prefix)
            gate, up = gate_and_up(prefix)
            layers.append(_Layer(
                input_norm=norm(prefix + "attn_norm.weight"),
                q=q, q_bias=q_bias, k=k, k_bias=k_bias, v=v, v_bias=v_bias,
                o=weights.need(prefix + "attn_output.weight"), o_bias=bias(prefix + "attn_output.bias"),
                post_norm=norm(prefix + "ffn_norm.weight"),
                gate=gate, up=up, down=weights.need(prefix + "ffn_down.weight"),
                q_norm=_head_norm(norm(prefix + "attn_q_norm.weight", optional=True), order),
                k_norm=_head_norm(norm(prefix + "attn_k_norm.weight", optional=True), order),
                attention_output_norm=norm(prefix + "post_attention_norm.weight") if gemma else None,
                mlp_output_norm=norm(prefix + "post_ffw_norm.weight") if gemma else None))
        for layer in layers:  # the block-format matrices in groups of 8 rows, for passes of several tokens
            for field in ("q", "k", "v", "o", "gate", "up", "down"):
                setattr(layer, field, interleaved(getattr(layer, field)))
        embed = weights.need("token_embd.weight")  # rows looked up one by one: kept as the file has it
        lm_head = weights.get("output.weight")
        rotary = [gguf_rotary_frequencies(weights, config)] + [
            rotary_frequencies(config, kind) for kind in _rotary_layer_types(config)[1:]]  # Gemma 3's local RoPE
        native._setup(config, rotary, embed, embed if lm_head is None else lm_head, norm("output_norm.weight"),
                      layers, "gguf", model_variant(config))
        # a block-format head is repacked on its first full use (`logits`): a draft that scores a reduced vocabulary
        # copies its rows from the file and never needs the whole head repacked (145 MB for the 0.5B); a tied one
        # (Gemma's) too, and its embedding lookups then read the repacked rows (a dense head is used as it is)
        native._unpacked_head = weights if isinstance(native.lm_head, QuantWeight) else None
        native.gguf_formats = dict(weights.formats)
        return native

    def _setup(self, config, rotary: list[tuple[torch.Tensor, float]], embed: Weight, lm_head: Weight,
               final_norm: torch.Tensor, layers: list[_Layer], weight_dtype, variant: Variant) -> None:
        """rotary: per rotary table (`_rotary_layer_types`), the inverse frequencies [r / 2] (r: `rotary_dim`) and
        the attention scaling of the model's rotary embedding."""
        self.ops = load_kernels()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = float(config.rms_norm_eps)
        self.max_positions = native_positions(config)
        self.weight_dtype = weight_dtype  # torch.float32 / torch.bfloat16, or "gguf" (block formats)
        self.gguf_formats: dict[str, int] = {}
        self.embed = embed  # [V, D]
        self.embed_as_filed = embed  # the same rows in the layout it was loaded in (a tied head repacks `embed`)
        self.lm_head = lm_head  # [V, D] (may be the embedding)
        self._unpacked_head: GGUFTensors | None = None  # the file of a head still to be repacked on first use
        self.final_norm = final_norm  # [D] float32
        self.layers = layers
        self.variant = variant
        # rotary tables, computed as transformers does (float32 angles) for the positions used so far: a position's
        # row depends on it alone, so growing the tables never changes a row (all 32k positions of Qwen2.5 would
        # hold 34 MB per model). One table per `_rotary_layer_types` (Gemma 3: its full layers', its local ones').
        # [Dh / 2] each: a partial rotary embedding's r / 2 frequencies, then angles of 0 (`rotary_row_order`)
        self.inv_freqs = [F.pad(inv_freq.detach().float(), (0, self.head_dim // 2 - inv_freq.numel()))
                          for inv_freq, _ in rotary]
        self.turned_pairs = rotary_dim(config) // 2  # columns i and i + Dh / 2 for i below it turn
        unturned = torch.arange(self.head_dim // 2) >= self.turned_pairs
        self._unturned = torch.cat([unturned, unturned])  # [Dh]: a partial rotary embedding's other dims
        self.rotary_scalings = [float(scaling) for _, scaling in rotary]
        self.cos_tables = self.sin_tables = [torch.empty(0, 2 * self.inv_freqs[0].numel())] * len(rotary)
        self._cover_positions(min(ROTARY_ROWS, self.max_positions))
        # the layers for a chain pass in one kernel call (`_layers`); the same tensors as `layers`, not copies
        self._stack = self.ops.LayerStack(self.n_heads, self.n_kv_heads, self.head_dim, self.eps,
                                          variant.attention_scale, variant.attention_softcap, variant.gelu)
        for index, layer in enumerate(layers):
            self._stack.add_layer(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, [
                (weight.blocks, weight.qtype, weight.interleaved, bias) if isinstance(weight, QuantWeight)
                else (weight.panels, -2, False, bias) if isinstance(weight, PanelWeight)
                else (weight, -1, False, bias)
                for weight, bias in ((layer.q, layer.q_bias), (layer.k, layer.k_bias), (layer.v, layer.v_bias),
                                     (layer.o, layer.o_bias), (layer.gate, None), (layer.up, None),
                                     (layer.down, None))],
                                  layer.attention_output_norm, layer.mlp_output_norm, variant.windows[index],
                                  variant.rope_tables[index])
        self._has_float32_matrices = not self.rows_batch_invariant
        self._loaded_on = threading.get_ident()  # the thread whose OpenMP team loading started (`_check_thread`)
        self._thread_warned = False

    def _cover_positions(self, n: int) -> None:
        """Rotary tables with at least the first n positions (doubling, up to max_positions). Rows are computed in
        blocks of ROTARY_ROWS positions that always start at a multiple of ROTARY_ROWS, so a position's row comes
        from the same computation whatever the tables held before (bit for bit, in every run)."""
        have = self.cos_tables[0].shape[0]
        if n <= have:
            return
        want = min(max(n, 2 * have), self.max_positions)
        cos_tables, sin_tables = [], []
        for inv_freq, scaling, old_cos, old_sin in zip(self.inv_freqs, self.rotary_scalings, self.cos_tables,
                                                       self.sin_tables):
            cos, sin = [old_cos], [old_sin]
            for start in range(have, want, ROTARY_ROWS):
                positions = torch.arange(start, start + ROTARY_ROWS, dtype=torch.float32)
                angles = positions[:, None] * inv_freq[None, :]  # [ROTARY_ROWS, Dh / 2]
                table = torch.cat([angles, angles], dim=-1)  # [ROTARY_ROWS, Dh]
                cos_rows, sin_rows = table.cos() * scaling, table.sin() * scaling
                # a partial rotary embedding's other dims stay as they are (transformers scales only turned ones)
                cos_rows[:, self._unturned], sin_rows[:, self._unturned] = 1.0, 0.0
                cos.append(cos_rows)
                sin.append(sin_rows)
            cos_tables.append(torch.cat(cos)[: self.max_positions])
            sin_tables.append(torch.cat(sin)[: self.max_positions])
        self.cos_tables, self.sin_tables = cos_tables, sin_tables

    @property
    def weight_bytes(self) -> int:
        """Bytes one step reads: every layer's matrices, norms and biases, the final norm and the LM head."""
        layers = sum(stored_bytes(getattr(layer, field.name)) for layer in self.layers for field in fields(_Layer))
        return layers + stored_bytes(self.final_norm) + stored_bytes(self.lm_head)

    @property
    def matmul_params(self) -> int:
        """Weights a token's forward multiplies by (what `weight_bytes` reads, counted in weights): the layers, the
        final norm and the LM head."""
        def count(weight: Weight | None) -> int:
            if weight is None:
                return 0
            rows, cols = (weight.numel(), 1) if isinstance(weight, torch.Tensor) else weight.shape
            return rows * cols

        return (sum(count(getattr(layer, field.name)) for layer in self.layers for field in fields(_Layer))
                + count(self.final_norm) + count(self.lm_head))

    def same_first_layers(self, other: "NativeLlama", depth: int) -> bool:
        """Whether `other` computes exactly what this model computes through its first `depth` layers: the same
        embedding, rotary tables and layer weights (the same tensors, or equal ones of the same dtype). Then the
        K/V one of them caches for a sequence are the other's too (self-speculation on a draft's parent). Models
        loaded apart are compared tensor by tensor: a read of their weights, once per drafter built."""
        if other is self:
            return True
        shape = (self.n_heads, self.n_kv_heads, self.head_dim, self.eps)
        if shape != (other.n_heads, other.n_kv_heads, other.head_dim, other.eps):
            return False
        if len(self.layers) < depth or len(other.layers) < depth:
            return False

        def same(a: Weight | None, b: Weight | None) -> bool:
            if a is None or b is None:
                return a is b
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):  # block formats, panels
                return a is b or (type(a) is type(b) and a.equal(b))
            return a is b or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))

        rotary = (len(self.inv_freqs) == len(other.inv_freqs)
                  and all(torch.equal(mine, theirs) for mine, theirs in zip(self.inv_freqs, other.inv_freqs))
                  and self.rotary_scalings == other.rotary_scalings and self.turned_pairs == other.turned_pairs)

        def first_layers(variant: Variant) -> Variant:  # the model-wide settings and those of the shared layers
            return dataclasses.replace(variant, windows=variant.windows[:depth],
                                       rope_tables=variant.rope_tables[:depth])

        return (same(self.embed_as_filed, other.embed_as_filed) and rotary
                and first_layers(self.variant) == first_layers(other.variant)
                and all(same(getattr(mine, field.name), getattr(theirs, field.name))
                        for mine, theirs in zip(self.layers[:depth], other.layers[:depth])
                        for field in fields(_Layer)))

    @property
    def rows_batch_invariant(self) -> bool:
        """Whether every layer's products give a row the same bits whatever its pass holds: no float32 matrix,
        which a pass over more than MAX_KERNEL_ROWS tokens sends to torch's matmul (`_linear`)."""
        return not any(isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
                       for layer in self.layers for weight in (layer.q, layer.k, layer.v, layer.o, layer.gate,
                                                               layer.up, layer.down))

    @property
    def most_rows_a_sequence(self) -> int | None:
        """The most tokens one sequence may put into a pass of `forward_many`: MAX_KERNEL_ROWS where the model has
        float32 matrices (its own `forward` of more takes torch's matmul), else no limit (None)."""
        return MAX_KERNEL_ROWS if self._has_float32_matrices else None

    def new_cache(self, capacity: int = 256) -> "NativeCache":
        return NativeCache(len(self.layers), self.n_kv_heads, self.head_dim, capacity)

    def _linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
                kernel_only: bool = False) -> torch.Tensor:
        """x [T, K] float32 @ weight [N, K]^T (+ bias) -> [T, N] float32. kernel_only: the batch-invariant kernels
        whatever T (a pass of several sequences, whose rows must come out as they would alone)."""
        if not isinstance(weight, torch.Tensor):  # block formats, panels: the batch-invariant kernels, any T
            return weight.linear(x, bias)
        if x.shape[0] <= MAX_KERNEL_ROWS or weight.dtype != torch.float32 or kernel_only:
            return self.ops.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """The residual stream entering layer 0: float32 [T, D]."""
        rows = take_rows(self.embed, torch.tensor(token_ids, dtype=torch.long))
        return rows if self.variant.embed_scale == 1.0 else rows * self.variant.embed_scale

    def layer_forward(self, index: int, hidden: torch.Tensor, cache: "NativeCache", start: int,
                      positions: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `index` for T rows whose K/V go to cache slots start .. start + T - 1 of that layer; they attend
        to every earlier slot of the layer (and, in a tree, to the slots `tree_mask` allows). Leaves
        cache.length alone: whoever drives the layers decides what is cached (a layer slice, LayerSkip-style,
        drives them one by one). hidden [T, D] float32 -> [T, D]."""
        return self._layer(index, hidden, [Segment(0, hidden.shape[0], cache, start, positions, tree_mask)])

    def _check_thread(self) -> None:
        """Warn once when passes run on another thread than the one that loaded the model, with several torch
        threads: each thread that starts OpenMP regions gets a team of its own, and with more OpenMP threads than
        cores every region waits for a wake-up (a third of a pass on the Zen 3; docs/performance.md)."""
        if self._thread_warned or threading.get_ident() == self._loaded_on or torch.get_num_threads() < 2:
            return
        self._thread_warned = True
        warnings.warn("this model runs on another thread than the one that loaded it: with several torch threads "
                      "each pass may be much slower (load and generate on one thread; docs/performance.md)",
                      RuntimeWarning, stacklevel=2)

    def _layers(self, hidden: torch.Tensor, segments: list["Segment"], kernel_only: bool = False) -> torch.Tensor:
        """Every layer over the rows of one or several sequences: chains whose every product goes through the
        kernels run in one call (`ops.LayerStack`: the same kernels in the same order as `_layer`, so the same
        bits); a tree, or a float32 matrix over more than MAX_KERNEL_ROWS rows (torch's matmul), layer by layer
        here. hidden [T, D] -> [T, D]."""
        self._check_thread()
        chains = all(segment.positions is None and segment.tree_mask is None for segment in segments)
        if chains and (kernel_only or hidden.shape[0] <= MAX_KERNEL_ROWS or not self._has_float32_matrices):
            self._cover_positions(max(segment.start + segment.n for segment in segments))
            return self._stack.forward(hidden.contiguous(), [segment.first for segment in segments],
                                       [segment.n for segment in segments],
                                       [segment.cache.keys for segment in segments],
                                       [segment.cache.values for segment in segments],
                                       [segment.start for segment in segments], self.cos_tables, self.sin_tables)
        for index in range(len(self.layers)):
            hidden = self._layer(index, hidden, segments, kernel_only)
        return hidden

    def _layer(self, index: int, hidden: torch.Tensor, segments: list["Segment"],
               kernel_only: bool = False) -> torch.Tensor:
        """Layer `index` over the rows of one or several sequences (`segments`): norms and matrix products over
        all rows at once, the rotary embedding, cache writes and attention per sequence. hidden [T, D] -> [T, D]."""
        ops, layer, variant = self.ops, self.layers[index], self.variant
        window, table = variant.windows[index], variant.rope_tables[index]
        n_rows = hidden.shape[0]
        x = ops.rms_norm(hidden, layer.input_norm, self.eps)  # [T, D]
        q = self._linear(x, layer.q, layer.q_bias, kernel_only)  # [T, H * Dh]
        k = self._linear(x, layer.k, layer.k_bias, kernel_only)  # [T, Hkv * Dh]
        v = self._linear(x, layer.v, layer.v_bias, kernel_only)
        if layer.q_norm is not None:  # each head's q and k normed on their own (rows of Dh)
            q = ops.rms_norm(q.view(-1, self.head_dim), layer.q_norm, self.eps).view(n_rows, -1)
        if layer.k_norm is not None:
            k = ops.rms_norm(k.view(-1, self.head_dim), layer.k_norm, self.eps).view(n_rows, -1)
        attended = []
        for segment in segments:
            rows, n = slice(segment.first, segment.first + segment.n), segment.n
            # rotary positions: the cache slots, or a tree's depths
            last = segment.start + n if segment.positions is None else int(segment.positions.max()) + 1
            self._cover_positions(last)
            keys, values = segment.cache.keys[index], segment.cache.values[index]
            # q and k rotated; k and v written to cache slots start .. start + n - 1 of this layer
            q_rotated = ops.rope_store(q[rows].view(n, self.n_heads, self.head_dim),
                                       k[rows].view(n, self.n_kv_heads, self.head_dim),
                                       v[rows].view(n, self.n_kv_heads, self.head_dim), self.cos_tables[table],
                                       self.sin_tables[table], segment.positions, keys, values, segment.start)
            if segment.tree_mask is not None and window and segment.tree_mask.shape[1] > window:
                raise SpecdraftError(f"a token tree over {segment.tree_mask.shape[1]} cache slots is wider than this "
                                     f"model's sliding window of {window} positions: draft a smaller tree")
            if segment.tree_mask is None:
                attended.append(ops.attention(q_rotated, keys, values, segment.start, window,
                                              variant.attention_scale, variant.attention_softcap))  # [n, H, Dh]
            else:
                attended.append(ops.tree_attention(q_rotated, keys, values,
                                                   segment.start + n - segment.tree_mask.shape[1], segment.tree_mask,
                                                   window, segment.positions, variant.attention_scale,
                                                   variant.attention_softcap))
        heads = attended[0] if len(attended) == 1 else torch.cat(attended)  # [T, H, Dh]
        attention_out = self._linear(heads.view(n_rows, -1), layer.o, layer.o_bias, kernel_only)  # [T, D]
        if layer.attention_output_norm is not None:
            attention_out = ops.rms_norm(attention_out, layer.attention_output_norm, self.eps)
        hidden = hidden + attention_out
        x = ops.rms_norm(hidden, layer.post_norm, self.eps)
        gate_mul = ops.gelu_tanh_mul if variant.gelu else ops.silu_mul
        gated = gate_mul(self._linear(x, layer.gate, None, kernel_only),
                         self._linear(x, layer.up, None, kernel_only))  # [T, I]
        mlp_out = self._linear(gated, layer.down, None, kernel_only)  # [T, D]
        if layer.mlp_output_norm is not None:
            mlp_out = ops.rms_norm(mlp_out, layer.mlp_output_norm, self.eps)
        return hidden + mlp_out

    def logits(self, hidden: torch.Tensor, lm_head: Weight | None = None, kernel_only: bool = False) -> torch.Tensor:
        """The final norm and the LM head over residual-stream rows: [T, D] -> float32 [T, V]. Any layer's
        output can go through them: that is an early exit (S2D, LayerSkip). lm_head: other rows to score
        instead of the model's head ([V_draft, D], a reduced draft vocabulary)."""
        head = self.full_head() if lm_head is None else lm_head
        return self.soft_capped(self._linear(self.ops.rms_norm(hidden.contiguous(), self.final_norm, self.eps), head,
                                             None, kernel_only))

    def soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's soft cap of the logits (others: as they are)."""
        return self.ops.softcap(logits, self.variant.final_softcap) if self.variant.final_softcap else logits

    def full_head(self) -> Weight:
        """The LM head for scoring every row: a GGUF head is repacked (`QuantWeight.interleave`) on first use; a head
        tied to the embedding is then the embedding too (its rows come back in the file's layout, the same values),
        so the file's copy is let go, not kept beside it."""
        if self._unpacked_head is not None:
            tied = self.embed is self.lm_head
            self.lm_head = self.lm_head.interleave(self._unpacked_head, pad=True)  # any vocabulary size
            if tied:  # (`embed_as_filed` keeps the file's view, for `same_first_layers`)
                self.embed = self.lm_head
            self._unpacked_head = None
        return self.lm_head

    def forward(self, token_ids: list[int], cache: "NativeCache", n_logits: int,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append `token_ids` at cache.length; return float32 logits [n_logits, V] of the last n_logits.

        A token tree (see SequenceState.forward_tree): positions [T] int64, the rotary position of each new token
        (default: its cache slot); tree_mask [T, W] bool over the last W cache slots (these T among them): which
        of them each new token sees, besides every slot before them."""
        return self.forward_with_features(token_ids, cache, n_logits, (), positions, tree_mask)[0]

    def forward_with_features(self, token_ids: list[int], cache: "NativeCache", n_logits: int,
                              feature_layers: tuple[int, ...] = (), positions: torch.Tensor | None = None,
                              tree_mask: torch.Tensor | None = None, lm_head: Weight | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, also returning the residual stream of every new token at `feature_layers`
        (Hugging Face's `output_hidden_states` indexing: 0 is the embedding, i the input of layer i, and
        n_layers the final-normed state the LM head reads) as float32 [T, len(feature_layers), D], or None.
        lm_head: rows to score instead of the model's head (see `logits`)."""
        ops = self.ops
        taps: dict[int, torch.Tensor] = {}
        n_new = len(token_ids)
        start = cache.length
        if start + n_new > self.max_positions:
            raise ValueError(f"position {start + n_new} is past the model's {self.max_positions} positions")
        cache.reserve(start + n_new)
        hidden = self.embed_tokens(token_ids)  # [T, D]
        if not feature_layers:
            hidden = self._layers(hidden, [Segment(0, n_new, cache, start, positions, tree_mask)])
            cache.length = start + n_new
            return self.logits(hidden[-n_logits:], lm_head), None  # [n_logits, V]
        for index in range(len(self.layers)):
            if index in feature_layers:
                taps[index] = hidden  # [T, D]; the loop rebinds `hidden`, so this tensor is not mutated
            hidden = self.layer_forward(index, hidden, cache, start, positions, tree_mask)
        cache.length = start + n_new
        normed = ops.rms_norm(hidden.contiguous(), self.final_norm, self.eps)  # [T, D]
        taps[len(self.layers)] = normed
        features = torch.stack([taps[i] for i in feature_layers], dim=1)  # [T, n_taps, D]
        head = self.full_head() if lm_head is None else lm_head
        return self.soft_capped(self._linear(normed[-n_logits:].contiguous(), head, None)), features  # [n_logits, V]

    def forward_many(self, passes: list[tuple[list[int], "NativeCache", int]],
                     heads: list[Weight | None] | None = None) -> list[torch.Tensor]:
        """Passes of several sequences as one: (token_ids, cache, n_logits) each, appended at each cache's length.
        heads: per pass, the rows to score instead of the model's head (None: all; see `logits`), e.g. each
        request's draft vocabulary; the passes that share a head are scored in one product.
        The norms and matrix products run over all their rows at once (the weights are read once for all), the
        rotary embedding, cache writes and attention per sequence over its own cache. Each sequence's logits
        [n_logits, V] are bit-identical to its own `forward` (the kernels are batch-invariant: a row's arithmetic
        never depends on the other rows), so a request's tokens never depend on who else is in the pass.
        n_logits 0: a chunk of a prompt's prefill riding along (its cache filled, no logits: [0, V]). A pass holds
        at most MAX_KERNEL_ROWS tokens where the model has float32 matrices (its `forward` of more takes torch's
        matmul, which these rows must not); any number where every product is the kernels'."""
        segments, token_ids = [], []
        most_rows = self.most_rows_a_sequence
        for ids, cache, n_logits in passes:
            if len(ids) < 1 or (most_rows is not None and len(ids) > most_rows) or not 0 <= n_logits <= len(ids):
                raise ValueError(f"a pass of forward_many holds 1 to {most_rows or 'any number of'} tokens and "
                                 f"returns logits for 0 to all of them; got {len(ids)} tokens, {n_logits} logits")
            if cache.length + len(ids) > self.max_positions:
                raise ValueError(f"position {cache.length + len(ids)} is past the model's {self.max_positions} "
                                 "positions")
            if any(cache is segment.cache for segment in segments):
                raise ValueError("forward_many takes one pass per cache")
            cache.reserve(cache.length + len(ids))
            segments.append(Segment(len(token_ids), len(ids), cache, cache.length))
            token_ids.extend(ids)
        hidden = self._layers(self.embed_tokens(token_ids), segments, kernel_only=True)  # [T, D]
        heads = heads or [None] * len(passes)
        by_head: dict[int, list[int]] = {}  # id of a head -> the passes it scores, in order
        for i, ((_, cache, _), segment) in enumerate(zip(passes, segments)):
            cache.length = segment.start + segment.n
            by_head.setdefault(id(heads[i]), []).append(i)
        logits: list[torch.Tensor | None] = [None] * len(passes)
        for members in by_head.values():
            rows = []  # the rows these passes want logits of, in order
            for i in members:
                segment, n_logits = segments[i], passes[i][2]
                rows.extend(range(segment.first + segment.n - n_logits, segment.first + segment.n))
            if not rows:  # prefill chunks alone under this head: nothing to score
                head = heads[members[0]]
                width = (self.full_head() if head is None else head).shape[0]
                for i in members:
                    logits[i] = hidden.new_empty((0, width))
                continue
            scored = self.logits(hidden[rows], heads[members[0]], kernel_only=True)  # [sum n_logits, V]
            for i, part in zip(members, scored.split([passes[i][2] for i in members])):
                logits[i] = part
        return logits


@dataclass
class Segment:
    """One sequence's rows in a pass: rows first .. first + n - 1 of the hidden states, their K/V going to slots
    start .. start + n - 1 of `cache`; positions and tree_mask as in `NativeLlama.forward` (None: a chain)."""

    first: int
    n: int
    cache: "NativeCache"
    start: int
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None


class NativeCache:
    """Preallocated K and V for one sequence: [layers, kv_heads, capacity, head_dim] float32 each."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int):
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape)
        self.values = torch.zeros(shape)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes holding the cached positions (not the spare capacity)."""
        return self.bytes_for(self.length)

    def bytes_for(self, positions: int) -> int:
        """Bytes the K and V of `positions` slots take."""
        return self.keys[:, :, :1].numel() * self.keys.element_size() * 2 * positions

    def reserve(self, length: int) -> None:
        """Make room for `length` positions; grows by doubling, keeping what is cached."""
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions: only the length changes."""
        self.length = min(self.length, length)

    def copy_from(self, other: "NativeCache", layers: int, start: int, stop: int) -> None:
        """Take the K/V of slots start .. stop - 1 of the first `layers` layers from another cache of the same
        head shape (a draft whose first layers are the target's adopts what the target cached; a prefix cache
        keeps and hands over a prompt's); the length is unchanged."""
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            mine[:layers, :, start:stop] = theirs[:layers, :, start:stop]

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the K/V of slots `source` [n] int64 to slots `destination` [n] (a tree's accepted path moving to
        consecutive slots); the length is unchanged."""
        for cached in (self.keys, self.values):
            cached[:, :, destination] = cached[:, :, source]  # the right side is gathered first: overlap is safe
