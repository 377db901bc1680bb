"""Drafters by name. Each registers once: its method name, how to build it, what it needs, and its settings as
dataclasses whose fields carry their command-line flag, help and parser. The engine's config (`SpecConfig`), the
CLI (`knobs.py`), the benchmark (`bench/options.py`, `bench/methods.py`) and the server's request schema
(`server/protocol.py`) derive their method names, flags and fields from here, so a new drafter setting is one field
in its drafter's options dataclass (its checks in that dataclass's __post_init__). Light on purpose (no torch): the
CLI builds its parser from it.

Every drafter setting, built in or registered from outside, travels in `SpecConfig.options` (the Python API also
takes them as keywords: `SpecConfig("draft", draft_confidence=0.3)`), and a builder reads its own with
`spec.drafter_options(TheOptions)`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable

from .checks import auto_to_none, check_types, paths_to_str
from .errors import SpecdraftError

MAX_GAMMA = 32  # draft tokens per pass, and levels of a tree
MAX_TREE_BUDGET = 64
MAX_LOOKUP_NGRAM = 16  # prompt lookup's longest n-gram
SETTINGS_OWNER = "SpecConfig"  # where a user gives a drafter setting: its type errors name it so


def setting(default: Any, help: str, flag: str | None = None, parse: Callable[[str], Any] | None = None,
            metavar: str | None = None, kind: str | None = None, server: bool = False) -> Any:
    """A field of a drafter's options dataclass. flag: its command-line spelling (default --the-field-name);
    parse: text -> value for the command line and the benchmark's method[...] settings (default: the type of
    the default); kind: what it takes, for error messages ("a row count or auto"; default from the type);
    server: whether a request may set it in its `speculative` field (a setting that names a file on the
    server's disk may not)."""
    return field(default=default, metadata={"help": help, "flag": flag, "parse": parse, "metavar": metavar,
                                            "kind": kind, "server": server})


def _count_or_auto(text: str, what: str) -> int | None:
    """"auto" (None) or a count >= 0; argparse prints the error as a one-line usage error."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected {what} >= 0 or auto, got {text!r}")
    return value


def parse_draft_vocab(text: str) -> int | None:
    """--draft-vocab: "auto" (None) or a row count."""
    return _count_or_auto(text, "a row count")


def parse_lookup_first(text: str) -> int | None:
    """--lookup-first: "auto" (None) or the shortest repeated n-gram to copy after (0: off)."""
    return _count_or_auto(text, "an n-gram length")


def parse_gamma(text: str) -> int | None:
    """--gamma: "auto" (None: each pass chooses, draft_length.py) or draft tokens per pass (SpecConfig checks
    the range, so that every front end says the same)."""
    return _count_or_auto(text, "a draft length")


def parse_layer_counts(text: str) -> tuple[int, ...]:
    """--exits "12,18,24" (or "12:18:24" inside a benchmark method's brackets) -> (12, 18, 24)."""
    try:
        return tuple(int(part) for part in text.replace(":", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts separated by commas, got {text!r}") from None


# ---------------------------------------------------------------------------------------- built-in settings

@dataclass(frozen=True)
class LookupOptions:
    """Prompt lookup (and lookup first, in front of another drafter): the longest and shortest n-gram of the
    context's end to look for earlier in it."""

    lookup_max_ngram: int = setting(3, "prompt lookup: longest n-gram of the context's end to look for earlier",
                                    server=True)
    lookup_min_ngram: int = setting(1, "prompt lookup: shortest such n-gram", server=True)

    def __post_init__(self) -> None:
        check_types(self, ints=("lookup_max_ngram", "lookup_min_ngram"), owner=SETTINGS_OWNER)
        if not (1 <= self.lookup_min_ngram <= self.lookup_max_ngram <= MAX_LOOKUP_NGRAM):
            raise SpecdraftError(f"prompt lookup needs 1 <= min n-gram <= max n-gram <= {MAX_LOOKUP_NGRAM}, got "
                                 f"{self.lookup_min_ngram} and {self.lookup_max_ngram}")


@dataclass(frozen=True)
class DraftModelOptions:
    """A draft model's chain or tree (--tree).

    draft_confidence: stop drafting once the draft's top-1 probability falls below it (0: never; a tree gives
    such a node no children); lossless, the length depends only on the draft's own distribution. draft_context:
    the draft model reads at most the last N tokens it has not seen (0: no limit): the prompt's last N at its first
    proposal, then the tokens generated since, and after a rest (plain passes, copies) in which more than N went by,
    the context's last N again. The whole prompt cost more than its better guesses gained (Zen 3, 2026-12-03: 16
    tokens 12.99 tok/s end to end, 64 12.36, the whole prompt 11.68). Fewer than 16 cost code its guesses: 4 tokens
    (Zen 4, 2026-12-07) lifted translation by 0.02x but took the load benchmark's coding prompts from 1.18x to 1.05x
    our plain decoding (replayed; at one client of `make bench-server` τ 1.86 -> 1.30); docs/performance.md."""

    draft_confidence: float = setting(0.0, "draft model: stop drafting when the draft's top-1 probability is below "
                                      "this (0: always draft gamma)", server=True)
    draft_context: int = setting(16, "draft model: read at most the last N tokens it has not seen (0: all): the "
                                 "prompt's end, and the context's end after a rest; the output stays exact",
                                 metavar="N", server=True)

    def __post_init__(self) -> None:
        check_types(self, ints=("draft_context",), numbers_=("draft_confidence",), owner=SETTINGS_OWNER)
        if not (0.0 <= self.draft_confidence < 1.0):
            raise SpecdraftError(f"draft confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_context < 0:
            raise SpecdraftError(f"draft context must be >= 0 tokens (0: the whole prompt), got {self.draft_context}")


@dataclass(frozen=True)
class DraftVocabOptions:
    """Drafters that score a draft model's LM head: only draft_vocab of its rows (drafters/vocab.py; 0 = all;
    sorted with trained adapters: the vocabulary they were trained on). None is auto: 32768 rows on the native
    backend when the vocabulary is larger (the 0.5B draft's head is a third of its step; measured 1.04-1.05x ->
    1.07-1.09x our AR in three interleaved runs, docs/s2d.md and docs/eagle.md), all rows on transformers."""

    draft_vocab: int | None = setting(
        None, "methods draft and sorted, chains and trees: score only the N most frequent rows of the draft's LM "
        "head, plus the prompt's tokens (0: all; auto, the default: 32768 on the native backend, all on "
        "transformers; exact either way)", parse=parse_draft_vocab, metavar="N|auto", kind="a row count or auto")

    def __post_init__(self) -> None:
        auto_to_none(self, "draft_vocab")
        check_types(self, ints=("draft_vocab",), optional=("draft_vocab",), owner=SETTINGS_OWNER)
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise SpecdraftError(f"draft vocabulary size must be >= 1 (0: the whole vocabulary, auto: chosen by "
                                 f"backend), got {self.draft_vocab}")


@dataclass(frozen=True)
class TreeOptions:
    """Token trees (EAGLE-2-style dynamic trees, drafters/tree.py): at most tree_budget draft nodes, tree_depth
    levels, the tree_branch most likely children of each expanded node; the verify pass covers budget + 1
    tokens. The default budget comes from the verify-cost curve T(k)/T(1) measured on a quiet machine, 2 threads,
    bf16 native, 1.5B target (2026-11-29): k=2 1.22, 3 1.44, 4 1.75, 6 2.04, 8 2.66, 16 4.30. The step from 4 to 6
    tokens is the cheapest per token on that curve, so 5 nodes (a 6-token pass, about 2 steps). A flatter curve
    (the kernels since, docs/performance.md) favours larger budgets: re-measure and override (--tree-budget)."""

    tree_budget: int = setting(5, "tree methods: draft nodes per target pass (the verify pass covers budget + 1 "
                               "tokens)")
    tree_depth: int = setting(4, "tree methods: levels at most")
    tree_branch: int = setting(2, "tree methods: most likely children tried per expanded node")

    def __post_init__(self) -> None:
        check_types(self, ints=("tree_budget", "tree_depth", "tree_branch"), owner=SETTINGS_OWNER)
        if not (1 <= self.tree_budget <= MAX_TREE_BUDGET):
            raise SpecdraftError(f"tree budget (draft nodes per pass) must be between 1 and {MAX_TREE_BUDGET}, "
                                 f"got {self.tree_budget}")
        if not (1 <= self.tree_depth <= MAX_GAMMA):
            raise SpecdraftError(f"tree depth must be between 1 and {MAX_GAMMA}, got {self.tree_depth}")
        if self.tree_branch < 1:
            raise SpecdraftError(f"tree branch (children per expanded node) must be >= 1, got {self.tree_branch}")


@dataclass(frozen=True)
class EagleOptions:
    """Method eagle: a trained EAGLE head, by name (~/.cache/specdraft/heads/NAME) or folder (ours or the EAGLE-3
    layout)."""

    eagle_head: str | None = setting(None, "method eagle: a trained head's name or folder")

    def __post_init__(self) -> None:
        paths_to_str(self, "eagle_head")
        check_types(self, strings=("eagle_head",), optional=("eagle_head",), owner=SETTINGS_OWNER)


@dataclass(frozen=True)
class SortedOptions:
    """S2D's sorted multi-exit draft (drafters/sorted.py): the draft's exits as layer counts, ascending (empty: a
    half, three quarters and all of the draft's layers); the rule that stops a token at an exit:
    "threshold:T1,T2,.." (stop at exit i when its top-1 probability > Ti; S2D's rule), "probe:T1,T2,.." (the same
    on the trained exit probes), "cost:W" (stop when 1 - top-1 <= W x the cost of the remaining layers as a fraction
    of a target pass) or "cost-probe:W" (the same on the probe); trained exit adapters (drafters/exit_adapters.py) by
    name or folder: "auto" uses the shipped ones trained for the draft model when there are any, "none" the bare
    exits (the final norm and LM head)."""

    sorted_exits: tuple[int, ...] = setting(
        (), "method sorted: the draft's exits as layer counts, e.g. 12,18,24 (default: half, three quarters and "
        "all of its layers)", flag="--exits", parse=parse_layer_counts, kind="layer counts")
    exit_rule: str = setting(
        "threshold:0.5", "method sorted: threshold:T1,T2,.. (stop at the first exit whose top-1 probability > "
        "Ti), probe:T1,T2,.. (stop where the trained exit probe's probability > Ti; the LM head runs once per "
        "token), cost:W (stop where 1 - top-1 <= W x the remaining layers' bytes over the target's) or "
        "cost-probe:W (the same on the probe's probability)")
    sorted_draft: str = setting("auto", "method sorted: trained exit adapters by name or folder (auto: the shipped "
                                "ones for the draft model, if any; none: bare exits)")

    def __post_init__(self) -> None:
        paths_to_str(self, "sorted_draft")
        exits = self.sorted_exits
        if isinstance(exits, list):
            object.__setattr__(self, "sorted_exits", exits := tuple(exits))
        if not (isinstance(exits, tuple) and all(isinstance(e, int) and not isinstance(e, bool) for e in exits)):
            raise SpecdraftError(f"{SETTINGS_OWNER}.sorted_exits must be a tuple of layer counts, got {exits!r}")
        if any(e < 1 for e in exits) or list(exits) != sorted(set(exits)):
            raise SpecdraftError(f"exits must be increasing layer counts >= 1, got {exits}")
        check_types(self, strings=("exit_rule", "sorted_draft"), owner=SETTINGS_OWNER)
        parse_exit_rule(self.exit_rule)  # raises on a malformed rule


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


# ------------------------------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class DrafterInfo:
    """One drafter as the front ends see it. build: (spec, target, draft model or None) -> Drafter, or its
    "module:function" path (imported on first use, so that this module stays light); tree_build: the same for
    its token-tree drafter (SpecConfig.tree, or the method spelled NAME-tree), None for a drafter of chains only.
    In a tree the depth plays gamma's part."""

    name: str
    build: str | Callable
    options: tuple[type, ...] = ()  # dataclasses whose fields are the settings it reads
    needs_draft_model: bool = False
    needs_head: bool = False  # a trained EAGLE head (EagleOptions.eagle_head)
    tree_build: str | Callable | None = None
    lookup_first: bool = True  # prompt lookup may go in front (False: it drafts by lookup already, or nothing)
    drafts: bool = True  # False: plain decoding (no draft, no gamma)


DRAFTERS: dict[str, DrafterInfo] = {}


def register(info: DrafterInfo) -> DrafterInfo:
    """Add (or replace) a drafter; every front end built afterwards offers it and its settings."""
    taken = resolve_method(info.name)
    if taken is not None and taken[1]:
        raise SpecdraftError(f"drafter name {info.name!r} spells {taken[0]!r} drafting trees; choose another")
    DRAFTERS[info.name] = info
    return info


def unregister(name: str) -> None:
    DRAFTERS.pop(name, None)


TREE_SUFFIX = "-tree"  # "draft-tree" is method "draft" drafting trees


def resolve_method(name: str) -> tuple[str, bool] | None:
    """(drafter, tree) for a method's spelling: a registered drafter's name (chains), or NAME-tree for one that
    drafts trees; None for anything else."""
    if name in DRAFTERS:
        return name, False
    base = name.removesuffix(TREE_SUFFIX)
    if base != name and base in DRAFTERS and DRAFTERS[base].tree_build is not None:
        return base, True
    return None


def tree_drafters() -> tuple[str, ...]:
    """The drafters that can draft token trees (tree_build)."""
    return tuple(name for name, info in DRAFTERS.items() if info.tree_build is not None)


def method_names() -> tuple[str, ...]:
    """Every method spelling: the drafters, then the tree spellings of those that draft trees."""
    return (*DRAFTERS, *(name + TREE_SUFFIX for name in tree_drafters()))


def option_classes() -> list[type]:
    """Every registered options dataclass, once, in registration order."""
    seen: list[type] = []
    for info in DRAFTERS.values():
        seen.extend(cls for cls in info.options if cls not in seen)
    return seen


def option_fields() -> dict[str, Field]:
    """Every drafter setting by name (a name two dataclasses share is one setting)."""
    out: dict[str, Field] = {}
    for cls in option_classes():
        for f in fields(cls):
            out.setdefault(f.name, f)
    return out


def default_of(f: Field) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


_BUILT = "specdraft.drafters.builders:"
for _info in (
        DrafterInfo("ar", _BUILT + "plain", lookup_first=False, drafts=False),
        DrafterInfo("draft", _BUILT + "draft_model", (DraftModelOptions, DraftVocabOptions, LookupOptions,
                                                      TreeOptions), needs_draft_model=True,
                    tree_build=_BUILT + "draft_tree"),
        DrafterInfo("prompt-lookup", _BUILT + "prompt_lookup", (LookupOptions, TreeOptions), lookup_first=False,
                    tree_build=_BUILT + "prompt_lookup_tree"),
        DrafterInfo("eagle", _BUILT + "eagle", (EagleOptions, LookupOptions, TreeOptions), needs_head=True,
                    tree_build=_BUILT + "eagle_tree"),
        DrafterInfo("sorted", _BUILT + "sorted_chain", (SortedOptions, DraftVocabOptions, LookupOptions, TreeOptions),
                    needs_draft_model=True, tree_build=_BUILT + "sorted_tree")):
    register(_info)
