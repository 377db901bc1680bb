"""Typed settings shared by the Python API, the CLI, and later the benchmark and the server."""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import SpecdraftError
from .registry import DRAFTERS, option_fields

MAX_GAMMA = 32
MAX_TREE_BUDGET = 64
MAX_LOOKUP_NGRAM = 16  # prompt lookup's longest n-gram
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


def check_types(config: object, ints: tuple[str, ...] = (), numbers_: tuple[str, ...] = (),
                strings: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
    """Python API callers pass values the CLI would have parsed: refuse a wrong type with a message that names the
    field, instead of a TypeError deep in torch (a bool is no number here; fields in `optional` may be None)."""
    def as_int(value):
        return operator.index(value)  # ints and numpy integers; not floats or strings

    def as_number(value):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError
        return float(value) if not isinstance(value, int) else value

    def as_string(value):
        if not isinstance(value, str):
            raise TypeError
        return value

    for names, convert, kind in ((ints, as_int, "an integer"), (numbers_, as_number, "a finite number"),
                                 (strings, as_string, "a string")):
        for name in names:
            value = getattr(config, name)
            if value is None and name in optional:
                continue
            try:
                if isinstance(value, bool):  # an int to Python, but no count or rate (numpy's bool is neither)
                    raise TypeError
                object.__setattr__(config, name, convert(value))  # numpy scalars become Python ones
            except TypeError:
                raise SpecdraftError(f"{type(config).__name__}.{name} must be {kind}"
                                     f"{' or None' if name in optional else ''}, got {value!r}") from None


def paths_to_str(config: object, *names: str) -> None:
    """A model, head or cache folder may be given as a pathlib.Path: kept as its string."""
    for name in names:
        if isinstance(getattr(config, name), os.PathLike):
            object.__setattr__(config, name, os.fspath(getattr(config, name)))


def auto_to_none(config: object, *names: str) -> None:
    """"auto", the CLI's and the server's spelling, means None (auto) in the Python API too."""
    for name in names:
        if getattr(config, name) == "auto":
            object.__setattr__(config, name, None)


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


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter proposes and how many tokens per target pass (gamma)."""

    method: str = "draft"
    # None is auto: each pass of a chain method chooses its length (see AUTO_GAMMA_MAX); tree methods ignore
    # gamma. Auto is the default since 2026-12-01: greedy it beat gamma 2 in three runs for prompt lookup and the
    # 0.5B draft (1.05-1.10x); at temperature 1 two 16-turn runs are inconclusive (-7 % to +1 %, sampling noise;
    # docs/performance.md, "Draft length per pass").
    gamma: int | None = None
    # model drafter: stop drafting early once the draft's top-1 probability falls below this (0 disables).
    # Lossless: the draft length depends only on the draft's own distribution.
    draft_confidence: float = 0.0
    # model drafter: the draft model reads only the prompt's last draft_context tokens (0: all of it) and the
    # tokens generated since. Its prefill of the whole prompt cost more than its better guesses gained: on the
    # quick benchmark (Zen 3, GGUF, 2026-12-03) 16 tokens ran 1.11x the whole prompt end to end (32: 1.09x, 64:
    # 1.06x, 128: 1.03x; acceptance 0.76 -> 0.70); docs/benchmarks.md
    draft_context: int = 16
    # prompt lookup: longest and shortest n-gram to match in the context
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    # any model or head drafter: draft by prompt lookup first when the context's last n-gram, n >= lookup_first
    # (up to lookup_max_ngram), occurred earlier, and by the drafter otherwise (drafters/lookup_first.py; 0: off).
    # None is auto: AUTO_LOOKUP_FIRST for model and head drafters, off for the methods whose registry entry
    # says lookup_first=False (they draft by lookup already, or draft nothing)
    # (see lookup_first_ngram)
    lookup_first: int | None = None
    # method eagle: a trained EAGLE head, by name (~/.cache/specdraft/heads/NAME) or folder (ours or EAGLE-3 layout)
    eagle_head: str | None = None
    # token trees (EAGLE-2-style dynamic trees, drafters/tree.py): at most tree_budget draft nodes, tree_depth
    # levels, the tree_branch most likely children of each expanded node. The verify pass covers budget + 1
    # tokens. Default from the verify-cost curve T(k)/T(1) measured on a quiet machine, 2 threads, bf16 native,
    # 1.5B target (2026-11-29): k=2 1.22, 3 1.44, 4 1.75, 6 2.04, 8 2.66, 16 4.30. The step from 4 to 6 tokens
    # is the cheapest per token on that curve, so 5 nodes (a 6-token pass, about 2 steps). A faster k > 1 kernel
    # flattens the curve and favours larger budgets: re-measure and override (--tree-budget). The kernel with
    # next-group prefetch (2026-11-29): k=2 1.08, 3 1.15, 4 1.42, 6 1.89, 16 4.57 against a faster T(1); the budget has
    # not been re-tuned end to end against it (docs/performance.md).
    tree_budget: int = 5
    tree_depth: int = 4
    tree_branch: int = 2
    # method sorted (S2D, drafters/sorted.py): the draft's exits as layer counts, ascending (empty: a half, three
    # quarters and all of the draft's layers), and the rule that stops a token at an exit:
    # "threshold:T1,T2,.." (stop at exit i when its top-1 probability > Ti; S2D's rule), "probe:T1,T2,.." (the
    # same on the trained exit probes), "cost:W" (stop when 1 - top-1 <= W x the cost of the remaining layers as
    # a fraction of a target pass) or "cost-probe:W" (the same on the probe).
    sorted_exits: tuple[int, ...] = ()
    exit_rule: str = "threshold:0.5"
    # method sorted: trained exit adapters (models/exit_adapters.py) by name or folder; "auto" uses the shipped
    # ones trained for the draft model when there are any, "none" the bare exits (the final norm and LM head)
    sorted_draft: str = "auto"
    # methods draft and sorted: score only this many rows of the draft's LM head (drafters/vocab.py; 0 = all;
    # sorted with trained adapters: the vocabulary they were trained on). None is auto: 32768 rows on the native
    # backend when the vocabulary is larger (the 0.5B draft's head is a third of its step; measured 1.04-1.05x
    # -> 1.07-1.09x our AR in three interleaved runs, docs/s2d.md and docs/eagle.md), all rows on transformers.
    draft_vocab: int | None = None
    # the settings of drafters registered from outside (registry.py) that are not fields above, by name: a dict
    # here, kept as sorted (name, value) pairs; a builder reads them with `drafter_options`
    options: Any = ()

    def __post_init__(self) -> None:
        options = dict(self.options) if isinstance(self.options, (dict, tuple, list)) else None
        if options is None:
            raise SpecdraftError(f"SpecConfig.options must be a dict of drafter settings, got {self.options!r}")
        own = {f.name for f in fields(self)}
        known = set(option_fields()) - own
        for name in options:
            if name not in known:
                raise SpecdraftError(f"SpecConfig.options: {name!r} is no registered drafter's setting"
                                     + (f" (it is a SpecConfig field: pass {name}= itself)" if name in own else
                                        f" (known: {', '.join(sorted(known)) or 'none'})"))
        # lists (JSON's arrays) become tuples: a SpecConfig is hashable (the server keeps engines by it)
        object.__setattr__(self, "options", tuple(sorted((name, tuple(value) if isinstance(value, list) else value)
                                                         for name, value in options.items())))
        auto_to_none(self, "gamma", "lookup_first", "draft_vocab")
        paths_to_str(self, "eagle_head", "sorted_draft")
        if isinstance(self.sorted_exits, list):
            object.__setattr__(self, "sorted_exits", tuple(self.sorted_exits))
        if not (isinstance(self.sorted_exits, tuple) and all(isinstance(e, int) and not isinstance(e, bool)
                                                             for e in self.sorted_exits)):
            raise SpecdraftError(f"SpecConfig.sorted_exits must be a tuple of layer counts, got {self.sorted_exits!r}")
        check_types(self, ints=("gamma", "lookup_max_ngram", "lookup_min_ngram", "lookup_first", "tree_budget",
                                "tree_depth", "tree_branch", "draft_vocab", "draft_context"),
                    numbers_=("draft_confidence",), strings=("method", "eagle_head", "exit_rule", "sorted_draft"),
                    optional=("gamma", "lookup_first", "eagle_head", "draft_vocab"))
        if self.method not in DRAFTERS:
            raise SpecdraftError(f"unknown method {self.method!r}; choose one of {', '.join(DRAFTERS)}")
        if self.method != "ar" and self.gamma is not None and not (1 <= self.gamma <= MAX_GAMMA):
            raise SpecdraftError(f"gamma must be between 1 and {MAX_GAMMA}, got {self.gamma}")
        if not (0.0 <= self.draft_confidence < 1.0):
            raise SpecdraftError(f"draft confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_context < 0:
            raise SpecdraftError(f"draft context must be >= 0 tokens (0: the whole prompt), got {self.draft_context}")
        if self.lookup_first is not None:
            if not (0 <= self.lookup_first <= self.lookup_max_ngram):
                raise SpecdraftError(f"lookup_first must be between 0 (off) and lookup_max_ngram "
                                     f"({self.lookup_max_ngram}), or auto; got {self.lookup_first}")
            if self.lookup_first and not DRAFTERS[self.method].lookup_first:
                takers = ", ".join(name for name, info in DRAFTERS.items() if info.lookup_first)
                raise SpecdraftError(f"lookup_first puts prompt lookup in front of a drafter; method {self.method!r} "
                                     f"has none to fall back on (use it with {takers}, or leave it auto)")
        if not (1 <= self.lookup_min_ngram <= self.lookup_max_ngram <= MAX_LOOKUP_NGRAM):
            raise SpecdraftError(f"prompt lookup needs 1 <= min n-gram <= max n-gram <= {MAX_LOOKUP_NGRAM}, got "
                                 f"{self.lookup_min_ngram} and {self.lookup_max_ngram}")
        if not (1 <= self.tree_budget <= MAX_TREE_BUDGET):
            raise SpecdraftError(f"tree budget (draft nodes per pass) must be between 1 and {MAX_TREE_BUDGET}, "
                                 f"got {self.tree_budget}")
        if not (1 <= self.tree_depth <= MAX_GAMMA):
            raise SpecdraftError(f"tree depth must be between 1 and {MAX_GAMMA}, got {self.tree_depth}")
        if self.tree_branch < 1:
            raise SpecdraftError(f"tree branch (children per expanded node) must be >= 1, got {self.tree_branch}")
        parse_exit_rule(self.exit_rule)  # raises on a malformed rule
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise SpecdraftError(f"draft vocabulary size must be >= 1 (0: the whole vocabulary, auto: chosen by "
                                 f"backend), got {self.draft_vocab}")
        if any(e < 1 for e in self.sorted_exits) or list(self.sorted_exits) != sorted(set(self.sorted_exits)):
            raise SpecdraftError(f"exits must be increasing layer counts >= 1, got {self.sorted_exits}")

    @property
    def lookup_first_ngram(self) -> int:
        """The shortest repeated n-gram whose continuation is copied before the drafter is asked (0: never)."""
        if self.lookup_first is not None:
            return self.lookup_first
        if not DRAFTERS[self.method].lookup_first or self.lookup_max_ngram < AUTO_LOOKUP_FIRST:
            return 0
        return AUTO_LOOKUP_FIRST

    @property
    def draft_len(self) -> int:
        """The most draft tokens one pass can accept: gamma for a chain (its cap when auto), the depth for a tree."""
        info = DRAFTERS[self.method]
        if not info.drafts:
            return 0
        if info.tree:
            return self.tree_depth
        return AUTO_GAMMA_MAX if self.gamma is None else self.gamma

    @property
    def adaptive_gamma(self) -> bool:
        """Whether each pass chooses its own draft length (gamma auto on a chain method)."""
        info = DRAFTERS[self.method]
        return self.gamma is None and info.drafts and not info.tree

    def drafter_options(self, cls: type):
        """The settings an options dataclass (registry.py) declares, as an instance of it: SpecConfig's field of
        each name, else the value in `options`, else the dataclass's default."""
        own, extra = self.__dataclass_fields__, dict(self.options)
        return cls(**{f.name: getattr(self, f.name) if f.name in own else extra[f.name]
                      for f in fields(cls) if f.name in own or f.name in extra})

    @property
    def gamma_shown(self) -> int | str:
        """The draft length as the server reports it: "auto", or draft_len."""
        return "auto" if self.adaptive_gamma else self.draft_len


def parse_exit_rule(text: str) -> tuple[str, tuple[float, ...]]:
    """"threshold:0.5,0.6" -> ("threshold", (0.5, 0.6)); "probe:0.6" -> ("probe", (0.6,));
    "cost:1.0" -> ("cost", (1.0,)); "cost-probe:1.0" -> ("cost-probe", (1.0,))."""
    kind, _, values = text.partition(":")
    try:
        numbers = tuple(float(v) for v in values.split(",")) if values else ()
    except ValueError:
        numbers = None
    if kind in ("threshold", "probe") and numbers and all(0.0 <= v <= 1.0 for v in numbers):
        return kind, numbers
    if kind in ("cost", "cost-probe") and numbers and len(numbers) == 1 and numbers[0] >= 0:
        return kind, numbers
    raise SpecdraftError(f"exit rule {text!r} not understood; use threshold:T1,T2,.. (top-1 probabilities in "
                         f"[0, 1], one per exit but the last), probe:T1,T2,.. (the trained exit probes' "
                         f"probabilities), cost:W or cost-probe:W (W >= 0)")


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
    # native: our batch-invariant Llama/Qwen2 forward; transformers: the model's own; auto: native if it applies
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
