"""A GGUF file of a model family's shapes with random weights: a file to time a family we have no weights of.

    python scripts/shaped_gguf.py gemma3-1b out/gemma3-1b-shape-q4_k_m.gguf [--type Q4_K_M] [--source DIR]

Shapes: gemma3-1b (Gemma 3 1B), gemma2-2b (Gemma 2 2B), llama3.2-1b (Llama 3.2 1B: Llama 3's RoPE, a tied head),
phi4-mini (Phi-4-mini, 3.8B: fused matrices, a long RoPE over 3/4 of each head, a tied head).

The model is built by transformers from the shapes below (random weights, bfloat16), given a packaged model's BPE
tokenizer no larger than its vocabulary (Qwen2.5's 151,665 tokens, or SmolLM2's 49,152; the rest of the family's
vocabulary is padding), converted by llama.cpp's own
`convert_hf_to_gguf.py` from the peer's source (the llama-cpp-python sdist `make peers` builds: downloaded again
unless --source names its unpacked `vendor/llama.cpp`), to F16, then quantized by the peer's `llama-quantize`. The
converter reads the vocabulary as GPT-2 BPE and keeps the padded rows. Text from such a file is noise and its greedy
output repeats itself (so prompt lookup's acceptance means nothing): time plain decoding, prefill and the verify
curve against llama.cpp on the same file. Needs the peer (`make peers`) and the `sentencepiece` package, which the
converter imports (`--extra-path` for a folder it was installed into with `pip install --target`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

QWEN, SMOLLM = ("qwen2.5-coder-0.5b-instruct", 151645), ("smollm2-135m-instruct", 2)  # tokenizer, its <|im_end|>
# transformers config class, the tokenizer, and the config's arguments, per shape
SHAPES = {
    "gemma3-1b": ("Gemma3TextConfig", QWEN, dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2-2b": ("Gemma2Config", QWEN, dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        tie_word_embeddings=True)),
    "llama3.2-1b": ("LlamaConfig", SMOLLM, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "phi4-mini": ("Phi3Config", QWEN, dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + i / 16 for i in range(48)],
                         "long_factor": [1.0 + i for i in range(48)]})),
}
# the converter's classes that would look for another kind of vocabulary read the BPE one, and Gemma 3's keeps the
# padded rows its converter drops
_CONVERTER_PATCH = """import runpy, sys
sys.path.insert(0, {source!r})
sys.argv[0] = {script!r}
import conversion.gemma as gemma
import conversion.llama as llama
import conversion.phi as phi
for model in (gemma.Gemma2Model, gemma.Gemma3Model, llama.LlamaModel, phi.Phi3MiniModel):
    model.set_vocab = lambda self: self._set_vocab_gpt2()
base = gemma.Gemma3Model.__mro__[1]
def keep_padded_rows(self, data_torch, name, bid):
    yield from base.modify_tensors(self, data_torch + self.norm_shift(name), name, bid)
gemma.Gemma3Model.modify_tensors = keep_padded_rows
runpy.run_path({script!r}, run_name="__main__")
"""


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from specdraft.bench.peer_build import download_sdist, extract_llama_cpp
    from specdraft.bench.peers import peer_binary
    from specdraft.models.fetch import cache_root, model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name (default Q4_K_M)")
    parser.add_argument("--source", type=Path, help="llama.cpp's source (the sdist's vendor/llama.cpp)")
    parser.add_argument("--extra-path", default="", help="a folder of Python packages the converter imports")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cache = cache_root()
    quantize = peer_binary(cache, "llama-quantize")
    config_class, (tokenizer_model, eos), shape = SHAPES[args.shape]
    tokenizer = model_dir(tokenizer_model, cache)
    if not quantize.is_file() or not (tokenizer / "tokenizer.json").is_file():
        print("needs the peer (make peers) and the packaged models (make run, or specdraft models fetch)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specdraft-shaped-") as work:
        work = Path(work)
        source = args.source or extract_llama_cpp(download_sdist(work), work)
        config = getattr(transformers, config_class)(**shape, eos_token_id=eos, bos_token_id=None, pad_token_id=0)
        torch.manual_seed(args.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        folder = work / "hf"
        model.save_pretrained(folder)
        del model
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(tokenizer / name, folder / name)
        wrapper = work / "convert.py"
        wrapper.write_text(_CONVERTER_PATCH.format(source=str(source),
                                                   script=str(source / "convert_hf_to_gguf.py")))
        f16 = work / "f16.gguf"
        path = ":".join(p for p in (str(source / "gguf-py"), args.extra_path) if p)
        subprocess.run([sys.executable, str(wrapper), str(folder), "--outfile", str(f16), "--outtype", "f16"],
                       check=True, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(quantize), str(f16), str(args.out), args.type], check=True)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
