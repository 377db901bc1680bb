"""The speculative-decoding mechanism's costs on a GPU, with random weights of the packaged models' shapes.

    python scripts/gpu_mechanism.py --out results.json            # on a CUDA machine
    python scripts/gpu_mechanism.py --device cpu --tiny           # a smoke run of the script itself

The packaged weights cannot travel to the GPU machine this project is sometimes lent (its copy limit is 64 MiB),
and acceptance rates need real weights, so this measures only what does not depend on them: the time of a
forward pass of k new tokens over a cached prefix (the verify-cost curve T(k)/T(1)), for

- the 1.5B target's shape (Qwen2, 28 layers, D 1536),
- the 0.5B draft's shape (24 layers, D 896; a draft step is one k = 1 pass of it),
- an EAGLE-head-like model (one decoder layer, D 1536, MLP 2048, an 8,192-row head, as our default head),
- the sorted (S2D) draft's exits: the 0.5B's first 8, 12 and 16 layers with its full head (one exit's step),
- a 7B target's shape (Qwen2.5-7B: 28 layers, D 3584), the larger target one sorted draft would also serve,

each in two ways: transformers' eager forward with its dynamic cache (what plain `generate` runs), and the same
forward captured once per k into a CUDA graph over a static cache (what a serving engine runs; no Python or
kernel-launch overhead per step). Only transformers and torch are needed (no specdraft import), so the script
runs on a machine that has them and nothing of ours. Each pass writes the same cache slots, so repeats are the
same work; the time is the median of --repeats passes after warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, StaticCache

SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
    "target-1.5b": (1536, 28, 12, 2, 8960, 151936, False),
    "draft-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "eagle-like": (1536, 1, 12, 2, 2048, 8192, False),
    "draft-0.5b-exit8": (896, 8, 14, 2, 4864, 151936, True),
    "draft-0.5b-exit12": (896, 12, 14, 2, 4864, 151936, True),
    "draft-0.5b-exit16": (896, 16, 14, 2, 4864, 151936, True),
    "target-7b": (3584, 28, 28, 4, 18944, 152064, False),
}
TINY = {name: (64, min(layers, 2), 4, 2, 128, 512, tied) for name, (_, layers, _, _, _, _, tied) in SHAPES.items()}


def build(shape, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    hidden, layers, heads, kv_heads, inter, vocab, tied = shape
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096, rope_theta=1e6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device: str, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def eager_curve(model, ks, prefix: int, device: str, repeats: int) -> dict[int, float]:
    """T(k) of the eager forward with a dynamic cache: k new tokens over `prefix` cached ones, cropped back."""
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)  # what plain generate decodes with
    prompt = torch.randint(0, vocab, (1, prefix), device=device)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    result = {}
    for k in ks:
        ids = torch.randint(0, vocab, (1, k), device=device)

        def one_pass(k=k, ids=ids):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.crop(-k)  # drop the k new tokens (transformers 5 counts from the end)

        result[k] = median_time(one_pass, device, repeats)
    return result


@torch.inference_mode()
def graph_curve(model, ks, prefix: int, device: str, repeats: int) -> dict[int, float]:
    """T(k) of the same forward over a static cache, captured into one CUDA graph per k (replayed)."""
    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=prefix + max(ks) + 8)
    prompt = torch.randint(0, vocab, (1, prefix), device=device)
    model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(prefix, device=device),
          use_cache=True)
    result = {}
    for k in ks:
        ids = torch.randint(0, vocab, (1, k), device=device)
        positions = torch.arange(prefix, prefix + k, device=device)

        def forward(k=k, ids=ids, positions=positions):
            logits = model(input_ids=ids, past_key_values=cache, cache_position=positions,
                           position_ids=positions[None], use_cache=True).logits
            # transformers 5.2x keeps the static cache's length in a device tensor that each pass advances: set
            # it back inside the pass (and inside the graph). Older versions write at cache_position only.
            for layer in getattr(cache, "layers", []):
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(prefix)
            return logits

        if device != "cuda":
            result[k] = median_time(forward, device, repeats)
            continue
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        result[k] = median_time(graph.replay, device, repeats)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of the script)")
    parser.add_argument("--models", default="", help="comma list of shapes to run (default: all)")
    parser.add_argument("--ks", default="1,2,3,4,6,8,12,16,24,32,48,64,96,128")
    parser.add_argument("--prefix", type=int, default=512, help="cached tokens before each pass")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    dtype = torch.bfloat16
    shapes = TINY if args.tiny else SHAPES
    if args.models:
        unknown = set(args.models.split(",")) - set(shapes)
        if unknown:
            parser.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(shapes)}")
        shapes = {name: shape for name, shape in shapes.items() if name in args.models.split(",")}
    report = {"command": "python scripts/gpu_mechanism.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dtype": "bfloat16",
              "torch": torch.__version__, "host": platform.node(), "prefix": args.prefix, "ks": ks, "models": {}}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    import transformers
    report["transformers"] = transformers.__version__
    for name, shape in shapes.items():
        model = build(shape, args.device, dtype)
        entry = {"weight_bytes": weight_bytes(model)}
        for mode, curve in (("eager", eager_curve), ("graph", graph_curve)):
            # record a failure and go on: one mode failing must not lose the other's numbers
            try:
                entry[mode] = {str(k): t for k, t in curve(model, ks, args.prefix, args.device, args.repeats).items()}
            except Exception as error:  # noqa: BLE001
                entry[mode] = {"error": f"{type(error).__name__}: {error}"[:500]}
            times = entry[mode]
            if "error" in times:
                print(f"{name:12s} {mode:6s} failed: {times['error']}")
                continue
            t1 = times["1"]
            row = "  ".join(f"k{k}={times[str(k)] / t1:.2f}" for k in ks)
            print(f"{name:12s} {mode:6s} T(1)={t1 * 1e3:7.2f} ms  {row}", flush=True)
        report["models"][name] = entry
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
