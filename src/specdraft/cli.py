"""`specdraft generate | answers | bench | models` — a user mistake prints one line and exits 2, no traceback."""

from __future__ import annotations

import argparse
import json
import sys

from .config import AUTO_GAMMA_MAX, DTYPES, MAX_GAMMA, ModelConfig, SamplingParams, SpecConfig
from .errors import SpecdraftError, require_extra
from .knobs import add_drafter_knob_args, drafter_knobs, parse_gamma
from .registry import DRAFTERS, method_names, tree_drafters

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from .models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET, help="packaged name, model directory or hub id")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for --method draft")
    parser.add_argument("--dtype", default="auto", help=f"one of {', '.join(DTYPES)} (bf16, fp32 also work); gguf: the "
                        "GGUF file's own quantized weights on the native backend; auto: gguf for a model that came from a "
                        "GGUF (the packaged ones), else bf16 on the native backend; on transformers bf16 where the CPU "
                        "has native bf16 (AVX512-BF16/AMX), else fp32")
    parser.add_argument("--cache-dir", default=None, help="where packaged models live (default $SPECDRAFT_CACHE "
                                                          "or ~/.cache/specdraft)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--backend", default="auto",
                        help="auto (native for Llama/Qwen2/Qwen3/Mistral, else transformers), native, or transformers")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings
                or isinstance(action.default, (list, tuple)) and not action.default):
            return text
        return text + " (default: %(default)s)"


class DefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands, at any depth, show defaults too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def _tree_help() -> str:
    return (f"draft token trees (methods {', '.join(tree_drafters())}; the same as METHOD-tree): the tree settings "
            "size the draft")


def build_parser() -> argparse.ArgumentParser:
    parser = DefaultsParser(prog="specdraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    gen.add_argument("prompt", nargs="?", default=None, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    _add_model_args(gen)
    gen.add_argument("--method", default="draft", help=f"one of {', '.join(method_names())}")
    gen.add_argument("--gamma", type=parse_gamma, default=SpecConfig.gamma, metavar="N|auto",
                     help=f"draft tokens per target pass (1..{MAX_GAMMA}; auto, the default: each pass chooses "
                     f"0..{AUTO_GAMMA_MAX} from the acceptance so far and this machine's measured verify cost)")
    gen.add_argument("--tree", action="store_true", default=None, help=_tree_help())
    add_drafter_knob_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, no chat template")
    gen.add_argument("--compare", action="store_true", help="also run plain autoregressive decoding and compare")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _add_model_args(serve)
    serve.add_argument("--no-draft", action="store_true", help="load no draft model (methods ar, prompt-lookup)")
    serve.add_argument("--method", default="draft", help=f"default for requests: one of {', '.join(method_names())}")
    serve.add_argument("--gamma", type=parse_gamma, default=SpecConfig.gamma, metavar="N|auto",
                       help=f"default draft tokens per target pass (1..{MAX_GAMMA}, or auto: the default)")
    serve.add_argument("--tree", action="store_true", default=None, help=_tree_help())
    add_drafter_knob_args(serve)  # the defaults of requests that do not set them
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None, help="the model id clients send (default: --target)")
    serve.add_argument("--max-queue", type=int, default=16,
                       help="requests that may wait for a place in the batch; more get 429")
    serve.add_argument("--max-batch", type=_parse_max_batch, default=None, metavar="N|auto",
                       help="requests generated together, each target pass scoring all of them (auto, the default: "
                            "the largest batch whose passes pay on this machine, timed once and cached)")
    serve.add_argument("--prefill-chunk", type=int, default=128, metavar="TOKENS",
                       help="prompt tokens prefilled between two passes of the running requests")
    serve.add_argument("--prefix-cache-mb", type=int, default=512, metavar="MIB",
                       help="memory for prompts' K/V kept for later prompts that begin the same way (a chat's "
                            "system prompt, a conversation's earlier turns); 0: prefill every prompt whole")
    serve.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds requests get to finish after SIGTERM before they end with an error (a "
                       "second SIGTERM ends them at once)")
    serve.add_argument("--log-level", default="info")

    from .bench.options import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmark methods side by side on a prompt suite"))

    from .bench.profile import add_profile_arguments

    add_profile_arguments(sub.add_parser("profile", help="measure costs on this machine: `profile verify`, the "
                                         "verify curve T(k)/T(1), ours beside llama.cpp's"))

    from .train.options import add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train a drafter on this machine (EAGLE head, sorted draft), export it"))

    answers = sub.add_parser("answers", help="answer-scale propose and verify: a small model N times with a "
                             "verifier against a large model once (docs/answers.md)")
    answers.add_argument("dataset", help="JSONL: id, context, question, answers (or HumanEval rows)")
    answers.add_argument("--small", default="qwen2.5-coder-0.5b-instruct")
    answers.add_argument("--large", default="qwen2.5-coder-1.5b-instruct")
    answers.add_argument("--n", type=int, default=10, help="samples from the small model per question")
    answers.add_argument("--temperature", type=float, default=0.7)
    answers.add_argument("--verifier", default=None, help="grounded | calculator | unit-tests (default: grounded "
                         "for questions, unit-tests for code)")
    answers.add_argument("--limit", type=int, default=None, help="first LIMIT questions of the seeded order")
    answers.add_argument("--seed", type=int, default=0)
    answers.add_argument("--max-new-tokens", type=int, default=None, help="default 16 (questions), 192 (code)")
    answers.add_argument("--dtype", default="auto")
    answers.add_argument("--threads", type=int, default=None)
    answers.add_argument("--out", required=True, help="folder for records.jsonl, summary.json, report.md, plot; "
                         "an existing run there with the same settings is resumed")

    models = sub.add_parser("models", help="the packaged models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch_p = models_sub.add_parser("fetch", help="download, verify and convert packaged models")
    fetch_p.add_argument("names", nargs="*", help="default: all packaged models")
    fetch_p.add_argument("--cache-dir", default=None)
    list_p = models_sub.add_parser("list", help="list packaged models, whether they are fetched, and their sizes; "
                                  ".gguf files of yours that were read")
    list_p.add_argument("--cache-dir", default=None)
    remove_p = models_sub.add_parser("remove", help="delete packaged models from the cache (fetched again on use), "
                                     "or what it holds for a .gguf file of yours (the file stays)")
    remove_p.add_argument("names", nargs="+", help="packaged model names or .gguf paths")
    remove_p.add_argument("--float-weights", action="store_true",
                          help="delete only the fp32 safetensors made for --dtype bf16/fp32 (the GGUF stays)")
    remove_p.add_argument("--cache-dir", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        require_extra(args.command)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "models":
            return cmd_models(args)
        if args.command == "answers":
            return cmd_answers(args)
        if args.command == "bench":
            from .bench.runner import cmd_bench

            return cmd_bench(args, sys.argv[1:] if argv is None else argv)
        if args.command == "train" and args.train_command == "chats":
            from .train.chats import cmd_train_chats

            return cmd_train_chats(args)
        if args.command == "train" and args.train_command == "sorted":
            from .train.sorted_train import cmd_train_sorted

            return cmd_train_sorted(args)
        if args.command == "train":
            from .train.eagle_train import cmd_train

            return cmd_train(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "profile":
            from .bench.profile import cmd_profile

            return cmd_profile(args)
    except SpecdraftError as exc:
        print(f"specdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdraft: interrupted", file=sys.stderr)
        return 130
    return 0


def cmd_models(args) -> int:
    from .models import fetch

    cache = fetch.cache_root(args.cache_dir)
    if args.models_command == "list":
        for name, model in fetch.PACKAGED_MODELS.items():
            state = "fetched" if fetch.is_fetched(name, cache) else "not fetched"
            sizes = fetch.stored_bytes(name, cache)
            stored = f"GGUF {sizes['gguf'] / 1e9:.2f} GB" if sizes["gguf"] else "-"
            if sizes["float_weights"]:
                stored += f" + fp32 {sizes['float_weights'] / 1e9:.1f} GB"
            print(f"{name:30s} {state:12s} {stored:26s} {model.about}")
        for folder, info in fetch.imported_files(cache):  # GGUF files of the user's, read once
            state = "read" if fetch.gguf_source(folder) else "changed or gone since read"
            print(f"{info['gguf_path']}: {state}; {fetch.bytes_under(folder) / 1e9:.2f} GB in {folder.name}")
        print(f"cache: {cache}")
        return 0
    if args.models_command == "remove":
        for name in args.names:  # every name checked before anything is deleted
            if not fetch.is_gguf_path(name):
                fetch.known_model(name)
        for name in args.names:
            if fetch.is_gguf_path(name):  # what the cache holds for a file of the user's (not the file)
                freed = fetch.remove_imported(name, cache, float_weights_only=args.float_weights)
                if freed is None:
                    print(f"{name}: the cache holds nothing for this file")
                    continue
            else:
                freed = fetch.remove(name, cache, float_weights_only=args.float_weights)
            print(f"{name}: {freed / 1e9:.2f} GB freed")
        return 0
    for name in args.names or list(fetch.PACKAGED_MODELS):
        print(f"{name}: {fetch.fetch(name, cache)}")
    return 0


def cmd_answers(args) -> int:
    from .answers.runner import AnswersConfig, run

    config = AnswersConfig(dataset=args.dataset, out=args.out, small=args.small, large=args.large, n=args.n,
                           temperature=args.temperature, verifier=args.verifier, limit=args.limit, seed=args.seed,
                           max_new_tokens=args.max_new_tokens, dtype=args.dtype, threads=args.threads)
    summary = run(config)
    from .answers.metrics import report_markdown

    print(report_markdown(summary))
    print(f"records, summary.json, report.md, accuracy_vs_n.png in {args.out}", file=sys.stderr)
    return 0


def _configs(args) -> tuple[ModelConfig, SpecConfig, SamplingParams]:
    models = ModelConfig(target=args.target, draft=args.draft, dtype=args.dtype, cache_dir=args.cache_dir,
                         threads=args.threads, backend=args.backend)
    spec = _spec(args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed)
    check_names(models, spec)
    return models, spec, params


def _parse_max_batch(text: str) -> int | None:
    """--max-batch: "auto" (None) or a count (ServerConfig checks its range)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests or auto, got {text!r}") from None


def _spec(args) -> SpecConfig:
    """The speculative configuration of `generate` and `serve`; a number for --gamma with a tree method is refused
    (a tree's depth, --tree-depth, plays its part: the number would be ignored)."""
    spec = SpecConfig(method=args.method, gamma=args.gamma, tree=args.tree, **drafter_knobs(args))
    if spec.tree and args.gamma is not None:
        raise SpecdraftError(f"--gamma sizes chains; method {spec.name!r} drafts trees, whose depth is --tree-depth "
                             f"({spec.setting('tree_depth')}): drop --gamma")
    return spec


def check_names(models: ModelConfig, spec: SpecConfig, draft_always: bool = False) -> None:
    """The model names and paths, checked before torch is even imported (load_engine checks them again): a
    mistyped --draft fails at once. draft_always: the draft is loaded whatever the method (the server's)."""
    from .models.fetch import check_model_names

    needed = draft_always or DRAFTERS[spec.method].needs_draft_model
    check_model_names(models.target, models.draft if needed else None)


def cmd_serve(args) -> int:
    from .server import ServerConfig, serve

    models = ModelConfig(target=args.target, draft=None if args.no_draft else args.draft, dtype=args.dtype,
                         cache_dir=args.cache_dir, threads=args.threads, backend=args.backend)
    spec = _spec(args)
    check_names(models, spec, draft_always=True)
    config = ServerConfig(host=args.host, port=args.port, model_name=args.model_name, max_queue=args.max_queue,
                          max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                          prefix_cache_mb=args.prefix_cache_mb, max_tokens_limit=args.max_tokens_limit,
                          default_max_tokens=args.default_max_tokens,
                          shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    if models.draft is None and DRAFTERS[spec.method].needs_draft_model:  # before loading and measuring anything
        raise SpecdraftError(f"the default method {spec.method!r} needs a draft model, and --no-draft loads none: "
                             f"choose another --method (e.g. prompt-lookup) or drop --no-draft")
    serve(models, spec, config)
    return 0


def cmd_generate(args) -> int:
    models, spec, params = _configs(args)  # validate everything before loading gigabytes
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not prompt.strip():
        raise SpecdraftError("the prompt is empty; give some text to continue")
    from .api import load_engine
    from .engine import Engine

    engine = load_engine(models, spec, progress=not args.json)
    prompt_ids = engine.encode(prompt, chat=not args.no_chat)
    if args.compare:  # warm-up so neither side pays first-call costs
        for warm in (engine, Engine(engine.target)):
            warm.generate(prompt_ids, SamplingParams(max_new_tokens=4))
    generation = engine.stream(prompt_ids, params)
    for chunk in generation:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = generation.result()
    if not args.json:
        print()
    baseline = Engine(engine.target).generate(prompt_ids, params) if args.compare else None
    if args.json:
        out = result.to_dict()
        out["target"], out["draft"] = models.target, models.draft if DRAFTERS[spec.method].needs_draft_model else None
        out["dtype"] = engine.target.dtype_name
        if baseline is not None:
            out["baseline"] = baseline.to_dict()
            out["identical"] = baseline.token_ids == result.token_ids
        print(json.dumps(out))
        return 0
    print(format_stats(result.stats), file=sys.stderr)
    if baseline is not None:
        print(format_comparison(result, baseline, engine.target.dtype_name, params),
              file=sys.stderr)
    return 0


def format_stats(stats) -> str:
    """One line of statistics; plain decoding (`ar`) drafts nothing, so it shows no draft length or acceptance."""
    per_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_per_position) or "-"
    gamma = f"auto≤{stats.gamma}, mean {stats.mean_draft_len:.1f}" if stats.gamma_auto else stats.gamma
    head = f"[{stats.method}]" if stats.method == "ar" else f"[{stats.method} γ={gamma}]"
    drafting = "" if stats.method == "ar" else (
        f"τ={stats.tau:.2f} (predicted {stats.predicted_tau:.2f}), acceptance {stats.acceptance_rate:.2f} "
        f"(α={stats.alpha:.2f}; per position {per_pos}); ")
    return (f"{head} {stats.new_tokens} tokens in {stats.time_total_s:.2f}s "
            f"({stats.tokens_per_s:.2f} tok/s), {stats.target_passes} target passes, {drafting}"
            f"time: prefill {stats.time_prefill_s:.2f}s, "
            f"draft {stats.time_draft_s:.2f}s, verify {stats.time_verify_s:.2f}s, other {stats.time_other_s:.2f}s; "
            f"finish: {stats.finish_reason}; backend: {describe_backends(stats)}")


def describe_backends(stats) -> str:
    """Which forward ran the target and the draft, and how many head rows the draft scored (automatic choices
    are visible here)."""
    text = f"target {stats.backend}"
    draft_backend, rows, lookup_first = (stats.drafter.get(name) for name in ("draft_backend", "draft_vocab",
                                                                               "lookup_first"))
    if draft_backend:
        text += f", draft {draft_backend}"
        text += f" ({rows:,}-row head + prompt tokens)" if rows else ""
    if lookup_first:
        text += f"; prompt lookup first after {lookup_first}-token repeats"
    return text


def format_comparison(spec_result, ar_result, dtype: str, params: SamplingParams) -> str:
    s, a = spec_result.stats, ar_result.stats
    identical = spec_result.token_ids == ar_result.token_ids
    speedup = s.tokens_per_s / a.tokens_per_s if a.tokens_per_s else 0.0
    if identical:
        verdict = "identical"
    else:
        common = next((i for i, (x, y) in enumerate(zip(spec_result.token_ids, ar_result.token_ids)) if x != y),
                      min(len(spec_result.token_ids), len(ar_result.token_ids)))
        why = ("sampling: equal in distribution, not token by token" if not params.greedy else
               "bf16 rounds a k-token verify differently from 1-token decoding" if dtype == "bfloat16"
               and spec_result.stats.backend != "native" else
               f"UNEXPECTED in {dtype} greedy: please report")
        verdict = f"differ from token {common} ({why})"
    return "\n".join([
        f"{'':14s}{'tok/s':>8s}{'tokens':>8s}{'passes':>8s}{'τ':>6s}{'accept':>8s}",
        f"{s.method:14s}{s.tokens_per_s:8.2f}{s.new_tokens:8d}{s.target_passes:8d}{s.tau:6.2f}"
        f"{s.acceptance_rate:8.2f}",
        f"{'ar (ours)':14s}{a.tokens_per_s:8.2f}{a.new_tokens:8d}{a.target_passes:8d}{a.tau:6.2f}{'-':>8s}",
        f"speedup {speedup:.2f}x ({dtype}); outputs {verdict}",
    ])


if __name__ == "__main__":
    sys.exit(main())
