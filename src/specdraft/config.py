"""Typed settings shared by the Python API, the CLI, and later the benchmark and the server."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .checks import auto_to_none, check_types, paths_to_str
from .errors import SpecdraftError
from .registry import (DRAFTERS, MAX_GAMMA, TREE_SUFFIX, default_of, method_names, option_classes, option_fields,
                       resolve_method, tree_drafters)

# lookup_first "auto" for every other method: copies after a repeated pair of tokens. Measured on two prompts per
# category, greedy, bf16 (docs/bench/2026-11-30-xeon-lookup-first-trees): eagle-tree 1.07x -> 1.39x our AR, draft 1.23x -> 1.31x
AUTO_LOOKUP_FIRST = 2
# gamma "auto" (None) on a chain method: each pass drafts 0..AUTO_GAMMA_MAX tokens, chosen from the request's
# acceptance so far and the target's measured verify-cost curve (draft_length.py)
AUTO_GAMMA_MAX = 8
DTYPES = ("auto", "gguf", "bfloat16", "float32", "float16")
BACKENDS = ("auto", "native", "transformers")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "float": "float32", "half": "float16"}


# what torch.Generator.manual_seed takes; the server allows less (protocol.MAX_SEED: 0.., with room for seed + i)
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            raise SpecdraftError(f"stop must be a list of strings, got the string {self.stop!r} (it would stop at "
                                 "each of its characters)")
        try:
            stop = () if self.stop is None else tuple(self.stop)  # a generator is read once, here
        except TypeError:
            stop = None
        if stop is None or not all(isinstance(s, str) for s in stop):
            raise SpecdraftError(f"stop must be a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        check_types(self, ints=("top_k", "max_new_tokens", "seed"), numbers_=("temperature", "top_p"),
                    optional=("seed",))
        if not (self.temperature >= 0):
            raise SpecdraftError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SpecdraftError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecdraftError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise SpecdraftError(f"max new tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise SpecdraftError("stop strings must not be empty")
        if self.seed is not None and not (SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise SpecdraftError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]} (64 bits), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, init=False)
class SpecConfig:
    """Which drafter proposes (method), how many tokens per target pass (gamma), whether prompt lookup goes in front
    of it (lookup_first), whether it drafts token trees (tree; "draft-tree" spells method "draft" with tree), and
    every drafter setting the registry declares (registry.py), by name: given as keywords,
    `SpecConfig("draft", 4, draft_confidence=0.3)`, or in `options`, a dict. Each setting's options
    dataclass checks it; one not given takes its default. `options` keeps them all as sorted (name, value) pairs,
    so that two configs that mean the same are equal and hash alike (the server keeps engines by SpecConfig); read
    one with `setting(name)`, or a drafter's own with `drafter_options(TheOptions)`."""

    method: str = "draft"
    # None is auto: each pass of a chain method chooses its length (see AUTO_GAMMA_MAX); tree methods ignore
    # gamma. Auto is the default since 2026-12-01: greedy it beat gamma 2 in three runs for prompt lookup and the
    # 0.5B draft (1.05-1.10x); at temperature 1 two 16-turn runs are inconclusive (-7 % to +1 %, sampling noise;
    # docs/performance.md, "Draft length per pass").
    gamma: int | None = None
    # any model or head drafter: draft by prompt lookup first when the context's last n-gram, n >= lookup_first
    # (up to lookup_max_ngram), occurred earlier, and by the drafter otherwise (drafters/lookup_first.py; 0: off).
    # None is auto: AUTO_LOOKUP_FIRST for model and head drafters, off for the methods whose registry entry
    # says lookup_first=False (they draft by lookup already, or draft nothing) (see lookup_first_ngram)
    lookup_first: int | None = None
    # draft token trees (EAGLE-2-style dynamic trees, drafters/tree.py; TreeOptions' settings), for the drafters
    # that can (registry.py tree_build): the tree's depth plays gamma's part
    tree: bool = False
    options: tuple[tuple[str, Any], ...] = ()  # every registered drafter setting, (name, value), sorted by name

    def __init__(self, method: str = "draft", gamma: int | None = None, lookup_first: int | None = None,
                 tree: bool | None = None, options: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
                 **settings: Any) -> None:
        if not isinstance(options, (Mapping, tuple, list)):
            raise SpecdraftError(f"SpecConfig.options must be a dict of drafter settings, got {options!r}")
        given = {**dict(options), **settings}
        known = option_fields()
        for name in given:
            if name not in known:
                raise SpecdraftError(f"SpecConfig: {name!r} is no registered drafter's setting (known: "
                                     f"{', '.join(sorted(known)) or 'none'})")
        values = {name: default_of(f) for name, f in known.items()}
        for cls in option_classes():  # each options dataclass checks and normalizes its own settings
            checked = cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
            values.update((f.name, getattr(checked, f.name)) for f in fields(cls))
        if tree is not None and not isinstance(tree, bool):
            raise SpecdraftError(f"SpecConfig.tree must be true or false, got {tree!r}")
        resolved = resolve_method(method) if isinstance(method, str) else None
        if resolved is not None:  # "draft-tree" is method "draft" with tree
            if tree is False and resolved[1]:
                raise SpecdraftError(f"method {method!r} drafts trees, and tree is false: drop one of them")
            method, tree = resolved[0], bool(tree) or resolved[1]
        tree = bool(tree)  # None: not given
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "gamma", gamma)
        object.__setattr__(self, "lookup_first", lookup_first)
        object.__setattr__(self, "tree", tree)
        # lists (JSON's arrays) become tuples: a SpecConfig is hashable
        object.__setattr__(self, "options", tuple(sorted(
            (name, tuple(value) if isinstance(value, list) else value) for name, value in values.items())))
        auto_to_none(self, "gamma", "lookup_first")
        check_types(self, ints=("gamma", "lookup_first"), strings=("method",), optional=("gamma", "lookup_first"))
        if self.method not in DRAFTERS:
            raise SpecdraftError(f"unknown method {self.method!r}; choose one of {', '.join(method_names())}")
        if self.tree and DRAFTERS[self.method].tree_build is None:
            raise SpecdraftError(f"method {self.method!r} drafts chains only; token trees: "
                                 f"{', '.join(tree_drafters())}")
        if self.method != "ar" and self.gamma is not None and not (1 <= self.gamma <= MAX_GAMMA):
            raise SpecdraftError(f"gamma must be between 1 and {MAX_GAMMA}, got {self.gamma}")
        if self.lookup_first is not None:
            if not (0 <= self.lookup_first <= self.setting("lookup_max_ngram")):
                raise SpecdraftError(f"lookup_first must be between 0 (off) and lookup_max_ngram "
                                     f"({self.setting('lookup_max_ngram')}), or auto; got {self.lookup_first}")
            if self.lookup_first and not DRAFTERS[self.method].lookup_first:
                takers = ", ".join(name for name, info in DRAFTERS.items() if info.lookup_first)
                raise SpecdraftError(f"lookup_first puts prompt lookup in front of a drafter; method {self.name!r} "
                                     f"has none to fall back on (use it with {takers}, or leave it auto)")

    def setting(self, name: str) -> Any:
        """A drafter setting's value (registry.py), by name (one registered after this config was made: its
        default)."""
        values = dict(self.options)
        if name in values:
            return values[name]
        if name in option_fields():
            return default_of(option_fields()[name])
        raise SpecdraftError(f"{name!r} is no registered drafter's setting")

    @property
    def lookup_first_ngram(self) -> int:
        """The shortest repeated n-gram whose continuation is copied before the drafter is asked (0: never)."""
        if self.lookup_first is not None:
            return self.lookup_first
        if not DRAFTERS[self.method].lookup_first or self.setting("lookup_max_ngram") < AUTO_LOOKUP_FIRST:
            return 0
        return AUTO_LOOKUP_FIRST

    @property
    def draft_len(self) -> int:
        """The most draft tokens one pass can accept: gamma for a chain (its cap when auto), the depth for a tree."""
        if not DRAFTERS[self.method].drafts:
            return 0
        if self.tree:
            return self.setting("tree_depth")
        return AUTO_GAMMA_MAX if self.gamma is None else self.gamma

    @property
    def adaptive_gamma(self) -> bool:
        """Whether each pass chooses its own draft length (gamma auto on a chain method)."""
        return self.gamma is None and DRAFTERS[self.method].drafts and not self.tree

    @property
    def name(self) -> str:
        """The method as reports and the server show it: "draft", or "draft-tree" when it drafts trees."""
        return self.method + TREE_SUFFIX if self.tree else self.method

    def drafter_options(self, cls: type):
        """The settings an options dataclass (registry.py) declares, as an instance of it (a setting registered
        after this config was made: the dataclass's default)."""
        values = dict(self.options)
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @property
    def gamma_shown(self) -> int | str:
        """The draft length as the server reports it: "auto", or draft_len."""
        return "auto" if self.adaptive_gamma else self.draft_len


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """"8,16,24" -> (8, 16, 24); "" -> ()."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SpecdraftError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Which models to load and in what precision."""

    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str | None = "qwen2.5-coder-0.5b-instruct"
    dtype: str = "auto"  # a GGUF model's own block formats natively, else bf16 weights on the native backend (load_model)
    cache_dir: str | None = None
    threads: int | None = None
    # native: our batch-invariant Llama/Qwen2/Qwen3/Mistral forward; transformers: the model's own; auto: native if
    # it applies
    backend: str = "auto"

    def __post_init__(self) -> None:
        paths_to_str(self, "target", "draft", "cache_dir")
        check_types(self, ints=("threads",), strings=("target", "draft", "dtype", "cache_dir", "backend"),
                    optional=("threads", "draft", "cache_dir"))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "backend", normalize_backend(self.backend))
        check_threads(self.threads)


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 0:
        raise SpecdraftError(f"--threads must be >= 0 (0 or unset: every core this process may use), got {threads}")


def normalize_backend(name: str) -> str:
    if name not in BACKENDS:
        raise SpecdraftError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def normalize_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(name.lower(), name.lower())
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)} (or bf16, fp32, fp16)")
    return name


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them torch emulates bf16 matmuls and a k-token verify costs ~k decode steps."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str) -> str:
    """The torch dtype of a model loaded through transformers: 'auto' -> bfloat16 on CPUs with native bf16, float32
    elsewhere; other names pass through ('gguf' weights are read by the native backend, see models.adapter)."""
    name = normalize_dtype(name)
    if name == "gguf":
        raise SpecdraftError("--dtype gguf runs the native backend on a GGUF file's own weights; transformers cannot "
                             "load them that way: choose bfloat16 or float32")
    if name == "auto":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return name
