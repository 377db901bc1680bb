"""`specdraft bench` flags and the settings they become (no torch import here: the CLI builds its parser fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import ModelConfig, SamplingParams, SpecConfig, normalize_backend, normalize_dtype
from ..errors import SpecdraftError
from ..knobs import add_drafter_knob_args, drafter_knobs, parse_gamma, parse_setting, setting_kind
from ..registry import option_fields
from .report import VERSUS_HELP

# the packaged models run their GGUF weights (--dtype auto), which transformers' generate (the hf-* methods) cannot
# run: those need --dtype bfloat16 or float32; llama.cpp, the peer on the same file, needs `make peers`
DEFAULT_METHODS = ("ar", "draft", "prompt-lookup")


@dataclass(frozen=True)
class BenchSettings:
    prompts: str | None = None  # None: the committed suite
    categories: tuple[str, ...] = ()  # empty: all
    limit: int | None = None  # prompts per category
    methods: tuple[str, ...] = DEFAULT_METHODS
    target: str = ModelConfig.target
    draft: str | None = ModelConfig.draft
    gammas: tuple[int | None, ...] = (SpecConfig.gamma,)  # None: auto (each pass chooses its length)
    lookup_first: int | None = SpecConfig.lookup_first  # model and head drafters: prompt lookup first (0: off, None: auto)
    options: tuple = ()  # the run's drafter settings (registry.py) as sorted (name, value) pairs; absent: default
    max_new_tokens: int = 128
    dtype: str = "auto"
    backend: str = "auto"  # our methods' forward: auto, native or transformers (transformers' methods: their own)
    temperature: float = 0.0
    seed: int = 0
    out: str = "bench-out"
    chat: bool = True  # False: raw prompts, turns concatenated token-wise (models without a chat template)
    warmup_tokens: int = 8
    threads: int | None = None
    cache_dir: str | None = None
    command: str = ""
    resume: bool = False  # continue the run in `out`: prompts with every record present are not run again
    overwrite: bool = False  # start afresh although `out` holds records of an earlier run
    versus: tuple[str, ...] = ()  # method labels every method is compared with, paired, in the report

    def drafter_settings(self) -> dict:
        """SpecConfig keyword arguments: lookup_first and the run's drafter settings (registry.py)."""
        return {"lookup_first": self.lookup_first, "options": dict(self.options)}

    def drafter_values(self) -> dict:
        """Every registered drafter setting's value in this run, by name, as SpecConfig normalizes it (its default
        where the run sets none; "auto" as None)."""
        return dict(SpecConfig(options=dict(self.options)).options)

    def model_config(self) -> ModelConfig:
        return ModelConfig(target=self.target, draft=self.draft, dtype=self.dtype, cache_dir=self.cache_dir,
                           threads=self.threads, backend=self.backend)

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_new_tokens=max_new_tokens or self.max_new_tokens,
                              seed=self.seed)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def split_methods(text: str) -> tuple[str, ...]:
    """"ar,draft[draft_vocab=32768,gamma=3],sorted" -> ("ar", "draft[draft_vocab=32768,gamma=3]", "sorted"):
    commas inside brackets belong to the method."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return tuple(p.strip() for p in parts if p.strip())


def parse_method(text: str) -> tuple[str, dict]:
    """A benchmark method with optional drafter settings for this column only, e.g.
    "draft[draft_vocab=32768,gamma=3]" -> ("draft", {"gamma": 3, "options": {"draft_vocab": 32768}}). Keys are gamma,
    lookup_first and the drafters' settings (registry.py), parsed as on the command line (layer counts take
    "8:16:24"); the drafter settings go under "options"."""

    name, bracket, rest = text.partition("[")
    if not bracket:
        return text.strip(), {}
    if not rest.endswith("]"):
        raise SpecdraftError(f"method {text!r}: settings go in one pair of brackets, e.g. draft[gamma=3]")
    own = ("gamma", "lookup_first")  # SpecConfig's own; the rest are drafter settings
    known = [*own, *option_fields()]
    overrides: dict = {}
    options: dict = {}
    for item in rest[:-1].replace(";", ",").split(","):
        if not item.strip():
            continue
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in known:
            raise SpecdraftError(f"method {text!r}: {item.strip()!r} is not KEY=VALUE with a drafter setting as KEY "
                                 f"(one of {', '.join(known)})")
        try:
            (overrides if key in own else options)[key] = parse_setting(key, value)
        except (ValueError, argparse.ArgumentTypeError):
            raise SpecdraftError(f"method {text!r}: {key} takes {setting_kind(key)}, got {value!r}") from None
    if options:
        overrides["options"] = options
    return name.strip(), overrides


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET

    parser.add_argument("--prompts", default=None, help="JSON lines {question_id, category, turns} "
                        "(default: the committed suite data/bench/prompts.jsonl)")
    parser.add_argument("--categories", default="", help="comma list (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma list of benchmark methods; a "
                        "method may carry its own drafter settings for an A/B in one run, e.g. "
                        "draft,draft[draft_vocab=32768],sorted[sorted_draft=none;sorted_exits=12:18:24]")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--gamma", default="auto",
                        help="draft tokens per pass, or auto (each pass of our chain methods chooses; "
                        "transformers' prompt lookup then drafts its own default, 10); a comma list sweeps "
                        "(e.g. auto,2,4)")
    add_drafter_knob_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", help="auto (a packaged model: its GGUF weights, as gguf), gguf, "
                        "bfloat16 or float32; transformers' methods (hf-*) need bfloat16 or float32")
    parser.add_argument("--backend", default="auto",
                        help="our methods' forward: auto (native for Llama/Qwen2/Qwen3/Mistral), native or "
                             "transformers")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="directory for records.jsonl, summary.json, report.md")
    restart = parser.add_mutually_exclusive_group()
    restart.add_argument("--resume", action="store_true", help="continue the run in --out (same settings): prompts "
                         "whose records are all there are kept and skipped, a prompt cut off midway runs again")
    restart.add_argument("--overwrite", action="store_true", help="replace the records already in --out")
    parser.add_argument("--versus", action="append", default=[], metavar="LABEL", help="the report: " + VERSUS_HELP)
    parser.add_argument("--no-chat", action="store_true", help="raw prompts, no chat template")
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)


def bench_drafter_settings(args: argparse.Namespace) -> dict:
    """The drafter flags as BenchSettings fields (the drafter settings as sorted pairs)."""
    knobs = drafter_knobs(args)
    return {**knobs, "options": tuple(sorted(knobs["options"].items()))}


def settings_from_args(args: argparse.Namespace, command: str = "") -> BenchSettings:
    try:
        gammas = tuple(parse_gamma(g) for g in _comma_list(args.gamma))
    except argparse.ArgumentTypeError:
        raise SpecdraftError(f"--gamma takes draft lengths or auto separated by commas, got {args.gamma!r}") from None
    if len(set(gammas)) != len(gammas):
        raise SpecdraftError(f"--gamma lists a value twice: {args.gamma!r}")
    if not gammas:
        raise SpecdraftError("--gamma needs at least one value")
    methods = split_methods(args.methods)
    if not methods:
        raise SpecdraftError("--methods needs at least one method")
    if args.max_new_tokens < 1 or args.warmup_tokens < 1:
        raise SpecdraftError("--max-new-tokens and --warmup-tokens must be >= 1")
    return BenchSettings(prompts=args.prompts, categories=_comma_list(args.categories), limit=args.limit,
                         methods=methods, target=args.target, draft=args.draft, gammas=gammas,
                         **bench_drafter_settings(args),
                         max_new_tokens=args.max_new_tokens,
                         dtype=normalize_dtype(args.dtype), backend=normalize_backend(args.backend),
                         temperature=args.temperature, seed=args.seed,
                         out=args.out, chat=not args.no_chat, warmup_tokens=args.warmup_tokens,
                         threads=args.threads, cache_dir=args.cache_dir, command=command,
                         resume=args.resume, overwrite=args.overwrite, versus=tuple(args.versus))
