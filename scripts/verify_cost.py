"""Where a decode step's time goes, and the verify-cost curve T(k)/T(1).

    python scripts/verify_cost.py --model qwen2.5-coder-1.5b-instruct --dtype float32 --ks 1,2,3,4,6,8,12,16

For each backend (native, transformers) and k: the best of --repeats passes of k new tokens over a cached
prefix of --prefix tokens (the cache is rolled back to the prefix before each pass, so every pass is the same
work). For the native backend the time is split by kernel (per projection, attention, norms, SiLU) and the
rest (rotary, embedding, cache writes, Python). Each pass is held against the two machine limits: weight
bytes over the measured read bandwidth, and FLOPs over the measured matmul rate (--bandwidth, --flops).
Output: a table on stdout and, with --json FILE, the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from specdraft import load_model
from specdraft.models.adapter import set_threads


class TimedOps:
    """Wraps the native kernel module: same calls, each one timed under a label."""

    def __init__(self, ops, labels: dict[int, str]):
        self.ops, self.labels = ops, labels
        self.seconds: dict[str, float] = defaultdict(float)

    def __getattr__(self, name):
        fn = getattr(self.ops, name)

        def timed(*args):
            label = self.labels.get(id(args[1]), "linear") if name == "linear" else name
            start = time.perf_counter()
            out = fn(*args)
            self.seconds[label] += time.perf_counter() - start
            return out

        return timed


def measure_bandwidth_and_flops() -> tuple[float, float]:
    """Read bandwidth (sum over a 1 GB tensor) and float32 matmul rate (1024^3 GEMM), best of 3."""
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    best = min(_timed(lambda: big.sum()) for _ in range(3))
    bandwidth = big.numel() * 4 / best
    a = torch.randn(1024, 1024)
    flops = 2 * 1024 ** 3 / min(_timed(lambda: a @ a) for _ in range(3))
    return bandwidth, flops


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ks", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--backends", default="native,transformers")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    set_threads(None)
    bandwidth, flops = measure_bandwidth_and_flops()
    print(f"machine: read bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {flops / 1e9:.0f} GFLOP/s")
    ks = [int(k) for k in args.ks.split(",")]
    results = {"model": args.model, "dtype": args.dtype, "bandwidth": bandwidth, "flops": flops, "runs": []}
    for backend in args.backends.split(","):
        model = load_model(args.model, args.dtype, progress=False, backend=backend)
        if model.model is None:
            raise SystemExit("this script counts a float model's parameters: use --dtype float32 or bfloat16 (for "
                             "the GGUF weights: specdraft profile verify)")
        params = sum(p.numel() for p in model.model.parameters())
        embed = model.model.get_input_embeddings().weight
        # a pass reads every weight but the input embedding (only k rows of it), unless it is also the head
        tied = model.model.get_output_embeddings().weight is embed
        read_bytes = sum(p.numel() * p.element_size() for p in model.model.parameters()
                         if tied or p is not embed)
        flops_per_token = 2 * (params - (0 if tied else embed.numel()))
        native = model.native
        timed = None
        if native is not None:
            labels = {id(native.lm_head): "lm_head"}
            for layer in native.layers:
                for name in ("q", "k", "v", "o", "gate", "up", "down"):
                    labels[id(getattr(layer, name))] = name
            timed = TimedOps(native.ops, labels)
            native.ops = timed
        state = model.new_state()
        prefix = [(1000 + 7 * i) % 30000 for i in range(args.prefix)]
        base = None
        with torch.inference_mode():
            state.forward(prefix, 1)
            for index, k in enumerate([1] + ks):  # the first k = 1 warms up: neither printed nor the base
                best, best_split = float("inf"), {}
                for _ in range(args.repeats):
                    state.truncate(len(prefix))
                    if timed:
                        timed.seconds.clear()
                    elapsed = _timed(lambda: state.forward([(2000 + 13 * i) % 30000 for i in range(k)], k))
                    if elapsed < best:
                        best, best_split = elapsed, dict(timed.seconds) if timed else {}
                if index == 0:
                    continue
                base = base or best  # T(1) when ks starts at 1 (the default)
                memory_bound = read_bytes / bandwidth
                compute_bound = flops_per_token * k / flops
                row = {"backend": backend, "k": k, "ms": best * 1e3, "ratio": best / base,
                       "bytes_limit_ms": memory_bound * 1e3, "flops_limit_ms": compute_bound * 1e3,
                       "split_ms": {name: s * 1e3 for name, s in best_split.items()}}
                if best_split:
                    row["split_ms"]["other"] = (best - sum(best_split.values())) * 1e3
                results["runs"].append(row)
                split = " ".join(f"{n}={v:.1f}" for n, v in sorted(row["split_ms"].items()))
                print(f"{args.model} {args.dtype} {backend:12s} k={k:2d} {best * 1e3:8.1f} ms ({best / base:4.2f}x)"
                      f"  limits: bytes {memory_bound * 1e3:.0f} ms, flops {compute_bound * 1e3:.0f} ms  {split}",
                      flush=True)
        del model, state
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
