"""Where the 1.5B target's prefill time goes (bf16 weights, native backend): its products through our kernel
against torch's bf16 `F.linear`, then whole prefills of 150 and 300 tokens with and without feature taps.

    python scripts/prefill_cost.py

2026-12-01 (AMD EPYC Zen 4, AVX512-BF16, 2 threads): the kernel 370-410 GFLOP/s at 64-300 rows, torch 340-420;
prefill 126-129 tokens/s (the model's products are about 2.6 GFLOP a token).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specdraft import load_model
from specdraft.models.adapter import set_threads
from specdraft.models.native.kernels import load_kernels


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    set_threads(2)
    ops = load_kernels()
    for rows in (64, 150, 300):
        for n, k in ((8960, 1536), (1536, 8960), (1536, 1536), (256, 1536)):  # MLP up/gate, down, q/o, k/v
            weight = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            x = torch.randn(rows, k)
            flops = 2 * rows * n * k
            ours = best_of(lambda: ops.linear(x, weight, None))
            theirs = best_of(lambda: F.linear(x.to(torch.bfloat16), weight).float())
            print(f"rows {rows} [{n}x{k}]: our kernel {flops / ours / 1e9:.0f} GFLOP/s, "
                  f"torch bf16 {flops / theirs / 1e9:.0f}", flush=True)
    target = load_model("qwen2.5-coder-1.5b-instruct", "auto", progress=False)
    with torch.inference_mode():
        for n in (150, 300):
            prompt = list(range(1000, 1000 + n))
            for taps in ((), (2, 14, 28)):
                target.new_state(feature_layers=taps).forward(prompt[:8], 1)  # warm up
                state = target.new_state(feature_layers=taps)
                started = time.perf_counter()
                state.forward(prompt, 1)
                elapsed = time.perf_counter() - started
                print(f"prefill of {n} tokens, taps {bool(taps)}: {elapsed * 1000:.0f} ms = {n / elapsed:.0f} "
                      f"tokens/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
