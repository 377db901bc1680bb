"""The target's verify-cost curve T(n) / T(1), n = 1 .. 9, after several cached context lengths (gamma auto
measures it after 64 and 512 tokens and interpolates: models/verify_curve.py).

    python scripts/verify_curve_context.py [--model qwen2.5-coder-1.5b-instruct] [--contexts 64,512,1536]
"""

from __future__ import annotations

import argparse

from specdraft import load_model
from specdraft.models.adapter import set_threads
from specdraft.models.verify_curve import measure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--contexts", default="64,512,1536")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    target = load_model(args.model, args.dtype)
    for context in (int(c) for c in args.contexts.split(",")):
        print(f"after {context} tokens: " + " ".join(f"{r:.2f}" for r in measure(target, 9, context)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
