"""Verify-cost curve T(k): one forward pass of k new tokens over a 40-token cached prefix.

    python scripts/verify_cost.py --model qwen2.5-coder-1.5b-instruct --dtype float32 --ks 1,2,4,8,16

Prints ms per pass with the weight-major linear path on and off (see specdraft/models/fastpath.py).
"""

import argparse
import time

import torch

from specdraft import load_model
from specdraft.models.adapter import set_threads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ks", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    set_threads(None)
    model = load_model(args.model, args.dtype, progress=False)
    prefix = list(range(1000, 1040))
    with torch.inference_mode():
        for weight_major in (True, False):
            model.weight_major = weight_major
            base = None
            for k in [1] + [int(k) for k in args.ks.split(",")]:  # the first k = 1 is a warm-up
                state = model.new_state()
                state.forward(prefix, 1)
                start = time.perf_counter()
                for _ in range(args.repeats):
                    state.forward(list(range(2000, 2000 + k)), k)
                ms = (time.perf_counter() - start) / args.repeats * 1000
                base = base or ms
                print(f"{args.model} {args.dtype} weight_major={weight_major} k={k:2d} {ms:8.1f} ms/pass "
                      f"({ms / base:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
