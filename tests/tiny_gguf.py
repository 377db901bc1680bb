"""Tiny GGUF files for tests: a tiny Hugging Face model (tiny.py) written as llama.cpp's converter writes it, its
matrices in a 32-weight block format quantized by the `gguf` package (IQ4_NL by `quantize_iq4_nl` below) or as F16,
laid out in a cache folder the way `specdraft models fetch` lays out the packaged models (so `load_model(dir,
"gguf")` finds the file)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

# Hugging Face parameter name (layer i as {i}) -> llama.cpp tensor name
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    # Phi-3's fused matrices
    "model.layers.{i}.self_attn.qkv_proj.weight": "blk.{i}.attn_qkv.weight",
    "model.layers.{i}.mlp.gate_up_proj.weight": "blk.{i}.ffn_up.weight",
}


# Gemma's layers: its post_attention_layernorm norms the attention's output; the norm before the MLP is another
_GEMMA_NAMES = {
    **_NAMES,
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}
_GGUF_ARCHITECTURE = {"gemma3_text": "gemma3"}  # llama.cpp's name where it is not transformers' model type


def _gguf_name(hf_name: str, gemma: bool = False) -> str:
    names = _GEMMA_NAMES if gemma else _NAMES
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[1] == "layers":
        index = parts[2]
        return names[".".join(parts[:2] + ["{i}"] + parts[3:])].format(i=index)
    return names[hf_name]


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's RoPE as a divisor of each unscaled frequency [head_dim / 2]: 1 for wavelengths under the context
    over high_freq_factor, `factor` over the context over low_freq_factor, between them the reciprocal of the
    blend (1 - s) / factor + s, s rising linearly in context / wavelength."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    context, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    divisor = 1.0 / ((1.0 - blend) / factor + blend)
    return divisor.astype(np.float32)


def permute_for_llama_cpp(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama model's Q and K rows: half-split rotary pairs to interleaved."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """float32 [rows, K] -> uint8 [rows, K / 32 * 18]: IQ4_NL blocks (d, then weight j in the low nibble of byte j,
    weight 16 + j in its high nibble; value d * IQ4_VALUES[nibble]), which the gguf package cannot write. Per 32
    weights d maps the one of largest magnitude to -127, the table's end; each weight takes the nearest value (no
    search for a better d, as llama.cpp does: a test file, not a good one)."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // 32, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    d = (extreme / -127).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    scaled = np.divide(blocks, d32, out=np.zeros_like(blocks), where=d32 != 0)
    q = np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    out = np.empty((rows, cols // 32, 18), dtype=np.uint8)
    out[..., :2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)


def write_gguf(hf_dir: Path, cache: Path, name: str, qtype: str = "Q8_0", mixed: str | None = None) -> Path:
    """Write hf_dir's model as <cache>/gguf/<name>.gguf (matrices in `qtype`; every other matrix in `mixed` when
    given) and <cache>/models/<name>/ (config, tokenizer, the marker naming the file). Returns the model folder."""
    import gguf
    from gguf.quants import quantize
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    (cache / "gguf").mkdir(parents=True, exist_ok=True)
    path = cache / "gguf" / f"{name}.gguf"
    writer = gguf.GGUFWriter(path, _GGUF_ARCHITECTURE.get(config.model_type, config.model_type))
    writer.add_block_count(config.num_hidden_layers)
    gemma = config.model_type.startswith("gemma")
    matrix = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:  # the converter writes no output.weight
            continue
        values = tensor.float().numpy()
        if gemma and hf_name.endswith("norm.weight"):  # as llama.cpp's converter stores Gemma's norms: 1 + weight
            values = values + 1.0
        if config.model_type == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            values = permute_for_llama_cpp(values, heads)
        if values.ndim == 2:
            kind = getattr(gguf.GGMLQuantizationType, mixed if mixed and matrix % 2 else qtype)
            matrix += 1
            blocks = quantize_iq4_nl(values) if kind == gguf.GGMLQuantizationType.IQ4_NL else quantize(values, kind)
            writer.add_tensor(_gguf_name(hf_name, gemma), blocks, raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(hf_name, gemma), values)
    rope = dict(config.rope_parameters)
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter writes it: a factor per frequency
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config.head_dim))
    if config.model_type == "phi3":  # as llama.cpp's converter writes Phi-3's RoPE (the folder's config holds it too)
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            original = config.original_max_position_embeddings
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = cache / "models" / name
    shutil.copytree(hf_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    if rope.get("rope_type") == "llama3":  # transformers' reading of such a file keeps no RoPE scaling
        saved = json.loads((folder / "config.json").read_text())
        saved["rope_parameters"] = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        (folder / "config.json").write_text(json.dumps(saved))
    (folder / "specdraft.json").write_text(json.dumps({"name": name, "gguf": path.name}))
    return folder
