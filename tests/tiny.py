"""Tiny random Hugging Face models and a character tokenizer, built on the fly (nothing downloaded)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHARS = string.ascii_lowercase[:10] + " ."  # 12 visible characters


def build_tokenizer(chars: str = CHARS):
    """Byte-level BPE with no merges: one token per character, the way Qwen2 and Llama tokenizers load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in chars:
        vocab["Ġ" if ch == " " else ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def build_model(path: Path, seed: int, vocab_size: int | None = None, layers: int = 2, hidden: int = 32,
                init_range: float = 0.3, arch: str = "qwen2", chars: str = CHARS,
                rope_parameters: dict | None = None, tied: bool = False) -> Path:
    """A random causal LM saved as a Hugging Face directory with the character tokenizer. arch: qwen2, llama,
    qwen3 (heads twice as wide as hidden / heads, as Qwen3's are wider than that, and random per-head q and k norms)
    or mistral; qwen2-window (Qwen2 with `use_sliding_window`, from the 2nd layer on); smollm3 (every 2nd layer
    without RoPE); phi3 (fused q/k/v and gate/up, Phi-4-mini's partial rotary embedding over half of each head and a
    long RoPE with random factors up to position 256); gemma2 and gemma3 (Gemma 3's text model). Sliding windows of
    6 positions (so that a dozen tokens cross them) on every layer of mistral and phi3, on qwen2-window's sliding
    layers and on the local layers of gemma; for gemma a query scale other than 1 / sqrt(head size), random norm
    weights, and Gemma 2's soft caps made small enough to change the logits.
    rope_parameters: the config's, where not the default RoPE. tied: the LM head is the embedding."""
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config)

    tokenizer = build_tokenizer(chars)
    vocab_size = vocab_size or len(tokenizer.get_vocab())
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig,
                    "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "smollm3": SmolLM3Config,
                    "phi3": Phi3Config, "qwen2-window": Qwen2Config}[arch]
    gemma = {"sliding_window": 6, "query_pre_attn_scalar": 24, "head_dim": hidden // 4,
             "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    extra = {"qwen3": {"head_dim": 2 * hidden // 4}, "mistral": {"sliding_window": 6},
             "smollm3": {"no_rope_layer_interval": 2},  # every 2nd layer without RoPE
             # Qwen's window, turned on, on the layers from the 2nd on
             "qwen2-window": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
             "phi3": {"sliding_window": 6, "original_max_position_embeddings": 256, "rope_parameters": {
                 "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                 "short_factor": [1.0 + 0.5 * i for i in range(hidden // 4 // 4)],
                 "long_factor": [2.0 + i for i in range(hidden // 4 // 4)]}},
             "gemma2": {**gemma, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0},
             "gemma3": {**gemma, "rope_parameters": {
                 "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}}.get(arch, {})
    if rope_parameters is not None:
        extra["rope_parameters"] = rope_parameters
    config = config_class(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, initializer_range=init_range, tie_word_embeddings=tied,
                          eos_token_id=1, bos_token_id=None, pad_token_id=0, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # <unk> never wins (logit 0 against random logits), <eos> only now and then
        head = model.get_output_embeddings().weight
        head[0].zero_()  # (tied: the embedding rows of <unk> and <eos>, which prompts do not hold)
        head[1].mul_(0.3)
        for name, weight in model.named_parameters():  # the head norms start as ones: make each weight count
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(0.5, 1.5)
            if arch.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's start as zeros (1 + weight)
                weight.uniform_(-0.5, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
