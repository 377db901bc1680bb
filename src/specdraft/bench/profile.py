"""`specdraft profile verify`: the target's verify-cost curve T(k) / T(1), k = 1 .. --max-tokens, ours beside
llama.cpp's on the same GGUF file.

Ours is measured by the code `gamma auto` uses (models/verify_curve.py `measure`: the median over rounds of each
round's T(k) / T(1), each pass over k new tokens after --context cached ones, every row's logits computed).
llama.cpp's comes from llama-bench's prompt-processing tests of 1 .. max tokens at depth --context
(`llama-bench -p 1,2,.. -n 0 -d CONTEXT`), the median of its repetitions per length. One difference remains: a
llama-bench pass computes the LM head for its last token only, where a verify pass needs a row per token, so its
curve leaves out k − 1 rows of the head (the 1.5B target's head is 1536 × 151,936: 233M of its 1.5B parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ..errors import SpecdraftError

DEFAULT_MAX_TOKENS = 16
DEFAULT_CONTEXT = 64  # verify_curve.PREFIX_TOKENS: the short curve gamma auto measures
DEFAULT_REPETITIONS = 5
MAX_TOKENS_LIMIT = 64
LM_HEAD_NOTE = ("llama-bench's passes compute the LM head for their last token only; a verify pass needs a row "
                "per token, so its curve leaves out k - 1 rows of the head")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.fetch import DEFAULT_TARGET

    sub = parser.add_subparsers(dest="profile_command", required=True)
    verify = sub.add_parser("verify", help="the target's verify cost T(k)/T(1): ours, and llama.cpp's on the same "
                            "GGUF file when `make peers` has built it")
    verify.add_argument("--target", default=DEFAULT_TARGET, help="packaged name or model folder (llama.cpp needs "
                        "its GGUF: packaged models and folders `specdraft models fetch` converted have one)")
    verify.add_argument("--dtype", default="auto", help="our weights' dtype, as everywhere (auto, bfloat16, "
                        "float32, ...)")
    verify.add_argument("--backend", default="auto", help="our forward: auto, native or transformers")
    verify.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="largest k (default 16)")
    verify.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                        help="cached tokens before each timed pass (default 64, gamma auto's short curve)")
    verify.add_argument("--threads", type=int, default=None, help="threads for both (default: every core this "
                        "process may use)")
    verify.add_argument("--repetitions", type=int, default=DEFAULT_REPETITIONS,
                        help="llama-bench's repetitions per length (default 5; ours: verify_curve's rounds)")
    verify.add_argument("--cache-dir", default=None)
    verify.add_argument("--json", action="store_true", help="print one JSON object")


def check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        raise SpecdraftError(f"--max-tokens must be 1..{MAX_TOKENS_LIMIT}, got {args.max_tokens}")
    if args.context < 1:
        raise SpecdraftError(f"--context must be >= 1, got {args.context}")
    if args.repetitions < 1:
        raise SpecdraftError(f"--repetitions must be >= 1, got {args.repetitions}")


def peer_curve(args: argparse.Namespace, cache, threads: int) -> tuple[dict | None, str | None]:
    """(llama.cpp's curve, None) or (None, why there is none)."""
    from .peers import existing_gguf, is_built, peer_info, run_llama_bench

    if not is_built(cache):
        return None, "llama.cpp is not built: run `make peers` to add its curve"
    try:
        gguf = existing_gguf(args.target, cache)
    except SpecdraftError as error:
        return None, str(error)
    curve = run_llama_bench(cache, gguf, args.max_tokens, args.context, threads, args.repetitions)
    curve.update(gguf=str(gguf), version=peer_info(cache).get("version"),
                 commit=peer_info(cache).get("llama_cpp_commit"), note=LM_HEAD_NOTE)
    return curve, None


def profile_verify(args: argparse.Namespace) -> dict:
    from ..config import ModelConfig
    from ..models.adapter import load_model, set_threads
    from ..models.fetch import cache_root
    from ..models.verify_curve import curve_from_rounds, time_passes

    check_args(args)
    config = ModelConfig(target=args.target, draft=None, dtype=args.dtype, cache_dir=args.cache_dir,
                         threads=args.threads, backend=args.backend)  # checks dtype, backend, threads
    set_threads(config.threads)
    import torch

    threads = torch.get_num_threads()
    cache = cache_root(config.cache_dir)
    target = load_model(config.target, config.dtype, config.cache_dir, progress=not args.json, backend=config.backend)
    room = (target.max_positions or args.context + args.max_tokens + 8) - args.max_tokens - 8
    if args.context > room:
        raise SpecdraftError(f"--context {args.context} leaves no room for {args.max_tokens} tokens in the model's "
                             f"{target.max_positions} positions; use at most {room}")
    started = time.perf_counter()
    rounds = time_passes(target, args.max_tokens, args.context)
    ours_s = time.perf_counter() - started
    ours = list(curve_from_rounds(rounds))
    # each length's pass in ms (median over rounds): the ratios are per round, so a one-token pass that a shared
    # host's memory slows for a minute moves a ratio less than these medians suggest
    ours_ms = [round(statistics.median(times[n] for times in rounds) * 1000, 2) for n in range(args.max_tokens)]
    one_token_range = [round(min(times[0] for times in rounds) * 1000, 2),
                       round(max(times[0] for times in rounds) * 1000, 2)]
    peer, missing = peer_curve(args, cache, threads)
    return {"target": args.target, "dtype_requested": config.dtype,
            "dtype": target.dtype_name, "backend": target.backend,
            "threads": threads, "context": args.context, "max_tokens": args.max_tokens,
            "ours": ours, "ours_ms": ours_ms, "ours_t1_ms": ours_ms[0], "ours_t1_ms_range": one_token_range,
            "ours_seconds": round(ours_s, 1), "llama_cpp": peer,
            "llama_cpp_missing": missing}


def format_profile(result: dict) -> str:
    peer = result["llama_cpp"]
    lines = [f"Verify cost T(k)/T(1) of {result['target']} after {result['context']} cached tokens, "
             f"{result['threads']} threads.",
             f"ours: {result['backend']} backend, --dtype {result.get('dtype_requested', '-')} (loaded as "
             f"{result['dtype']}; median over rounds of each round's ratio); T(1) {result['ours_t1_ms']:.2f} ms"
             + (" ({:.2f}-{:.2f} over the rounds)".format(*result["ours_t1_ms_range"])
                if result.get("ours_t1_ms_range") else "")]
    if peer:
        lines.append(f"llama.cpp {peer.get('version') or ''} ({(peer.get('commit') or 'commit unknown')[:10]}): "
                     f"llama-bench on {peer['gguf']} (median of its repetitions)")
    lines.append("")
    ours_ms = result.get("ours_ms")
    header = f"{'k':>3}  {'ours':>7}" + (f"  {'ours ms':>8}" if ours_ms else "")
    if peer:
        header += f"  {'llama.cpp':>9}  {'llama.cpp ms':>12}"
    lines.append(header)
    for k, ratio in enumerate(result["ours"], start=1):
        row = f"{k:>3}  {ratio:7.3f}" + (f"  {ours_ms[k - 1]:8.2f}" if ours_ms else "")
        if peer:
            row += f"  {peer['relative'][k - 1]:9.3f}  {peer['ms'][k - 1]:12.2f}"
        lines.append(row)
    lines.append("")
    lines.append(f"note: {LM_HEAD_NOTE}" if peer else f"llama.cpp: {result['llama_cpp_missing']}")
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    result = profile_verify(args)
    print(json.dumps(result) if args.json else format_profile(result))
    return 0
