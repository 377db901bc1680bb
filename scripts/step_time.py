"""Prefill rate, one-token step time and T(k)/T(1) of a model on the native backend, in one process.

    python scripts/step_time.py --model qwen2.5-coder-1.5b-instruct --dtype gguf --threads 2

A 426-token prompt of random ids is prefilled (timed once), then passes of k tokens after it are timed (median of
15 one-token passes, 7 of each longer one; the cache is rolled back after each pass). Numbers from one run are
comparable with each other; on a shared or drifting machine, compare builds or dtypes in an interleaved run.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.models.adapter import load_model

PROMPT_TOKENS = 426


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ks", default="2,4,8,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_model(args.model, args.dtype, progress=False)
    print(f"{args.model} ({model.dtype_name}), {args.threads} threads: loaded in {time.perf_counter() - started:.1f} s")
    ids = torch.randint(0, 150000, (PROMPT_TOKENS + 20,), generator=torch.Generator().manual_seed(0)).tolist()
    state = model.new_state(capacity=PROMPT_TOKENS + 64)
    with torch.inference_mode():
        started = time.perf_counter()
        state.forward(ids[:PROMPT_TOKENS], 1)
        print(f"prefill of {PROMPT_TOKENS} tokens: {PROMPT_TOKENS / (time.perf_counter() - started):.1f} tok/s")

        def median_pass(k: int, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                state.forward(ids[PROMPT_TOKENS: PROMPT_TOKENS + k], 1)
                times.append(time.perf_counter() - started)
                state.truncate(PROMPT_TOKENS)
            return sorted(times)[len(times) // 2]

        one = median_pass(1, 15)
        print(f"one-token step: {one * 1e3:.1f} ms ({1 / one:.1f} tok/s)")
        for k in (int(k) for k in args.ks.split(",")):
            print(f"T({k})/T(1) = {median_pass(k, 7) / one:.2f}")


if __name__ == "__main__":
    main()
