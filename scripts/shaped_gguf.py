"""A GGUF file of a model family's shapes with random weights: a file to time a family we have no weights of.

    python scripts/shaped_gguf.py gemma3-1b out/gemma3-1b-shape-q4_k_m.gguf [--type Q4_K_M] [--source DIR]

The model is built by transformers from the shapes below (random weights, bfloat16), given Qwen2.5's tokenizer (from
the packaged 0.5B: ids below 151,665; the rest of the family's vocabulary is padding), converted by llama.cpp's own
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

# transformers config class and its arguments, per shape
SHAPES = {
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
# the converter's classes that would read a SentencePiece vocabulary, and that drop the rows past it
_CONVERTER_PATCH = """import runpy, sys
sys.path.insert(0, {source!r})
sys.argv[0] = {script!r}
import conversion.gemma as gemma
for model in (gemma.Gemma2Model, gemma.Gemma3Model):
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
    tokenizer = model_dir("qwen2.5-coder-0.5b-instruct", cache)
    if not quantize.is_file() or not (tokenizer / "tokenizer.json").is_file():
        print("needs the peer (make peers) and the packaged models (make run, or specdraft models fetch)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specdraft-shaped-") as work:
        work = Path(work)
        source = args.source or extract_llama_cpp(download_sdist(work), work)
        config_class, shape = SHAPES[args.shape]
        config = getattr(transformers, config_class)(**shape, eos_token_id=151645, bos_token_id=None, pad_token_id=0)
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
