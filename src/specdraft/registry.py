"""Drafters by name. Each registers once: its method name, how to build it, what it needs, and its settings as
dataclasses whose fields carry their command-line flag, help and parser. The engine's config (`SpecConfig`), the
CLI (`knobs.py`), the benchmark (`bench/options.py`, `bench/methods.py`) and the server's request schema
(`server/protocol.py`) derive their method names, flags and fields from here, so a new drafter setting is one field
in its drafter's options dataclass. Light on purpose (no torch): the CLI builds its parser from it.

The built-in drafters' settings are also `SpecConfig` fields of the same names (the Python API's spelling); the
settings of a drafter registered from outside travel in `SpecConfig.options`, and a builder reads either kind with
`spec.drafter_options(TheOptions)`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable


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
    """Prompt lookup (and lookup first, in front of another drafter)."""

    lookup_max_ngram: int = setting(3, "prompt lookup: longest n-gram of the context's end to look for earlier",
                                    server=True)
    lookup_min_ngram: int = setting(1, "prompt lookup: shortest such n-gram", server=True)


@dataclass(frozen=True)
class DraftModelOptions:
    """A draft model's chain."""

    draft_confidence: float = setting(0.0, "draft model: stop drafting when the draft's top-1 probability is below "
                                      "this (0: always draft gamma)", server=True)
    draft_context: int = setting(16, "draft model: read only the prompt's last N tokens (0: all of it): the draft's "
                                 "prefill costs less, its guesses get a little worse, the output stays exact",
                                 metavar="N", server=True)


@dataclass(frozen=True)
class DraftVocabOptions:
    """Drafters that score a draft model's LM head."""

    draft_vocab: int | None = setting(
        None, "methods draft and sorted: score only the N most frequent rows of the draft's LM head, plus the "
        "prompt's tokens (0: all; auto, the default: 32768 on the native backend, all on transformers; exact "
        "either way)", parse=parse_draft_vocab, metavar="N|auto", kind="a row count or auto")


@dataclass(frozen=True)
class TreeOptions:
    """Token trees (EAGLE-2-style dynamic trees, drafters/tree.py)."""

    tree_budget: int = setting(5, "tree methods: draft nodes per target pass (the verify pass covers budget + 1 "
                               "tokens)")
    tree_depth: int = setting(4, "tree methods: levels at most")
    tree_branch: int = setting(2, "tree methods: most likely children tried per expanded node")


@dataclass(frozen=True)
class EagleOptions:
    eagle_head: str | None = setting(None, "method eagle: a trained head's name or folder")


@dataclass(frozen=True)
class SortedOptions:
    """S2D's sorted multi-exit draft (drafters/sorted.py)."""

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


# ------------------------------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class DrafterInfo:
    """One drafter as the front ends see it. build: (spec, target, draft model or None) -> Drafter, or its
    "module:function" path (imported on first use, so that this module stays light)."""

    name: str
    build: str | Callable
    options: tuple[type, ...] = ()  # dataclasses whose fields are the settings it reads
    needs_draft_model: bool = False
    needs_head: bool = False  # a trained EAGLE head (EagleOptions.eagle_head)
    tree: bool = False  # drafts token trees: the tree depth plays gamma's part
    lookup_first: bool = True  # prompt lookup may go in front (False: it drafts by lookup already, or nothing)
    drafts: bool = True  # False: plain decoding (no draft, no gamma)


DRAFTERS: dict[str, DrafterInfo] = {}


def register(info: DrafterInfo) -> DrafterInfo:
    """Add (or replace) a drafter; every front end built afterwards offers it and its settings."""
    DRAFTERS[info.name] = info
    return info


def unregister(name: str) -> None:
    DRAFTERS.pop(name, None)


def method_names() -> tuple[str, ...]:
    return tuple(DRAFTERS)


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
        DrafterInfo("draft", _BUILT + "draft_model", (DraftModelOptions, DraftVocabOptions, LookupOptions),
                    needs_draft_model=True),
        DrafterInfo("prompt-lookup", _BUILT + "prompt_lookup", (LookupOptions,), lookup_first=False),
        DrafterInfo("draft-tree", _BUILT + "draft_tree", (TreeOptions, LookupOptions), needs_draft_model=True,
                    tree=True),
        DrafterInfo("prompt-lookup-tree", _BUILT + "prompt_lookup_tree", (TreeOptions, LookupOptions), tree=True,
                    lookup_first=False),
        DrafterInfo("eagle", _BUILT + "eagle", (EagleOptions, LookupOptions), needs_head=True),
        DrafterInfo("eagle-tree", _BUILT + "eagle_tree", (EagleOptions, TreeOptions, LookupOptions), needs_head=True,
                    tree=True),
        DrafterInfo("sorted", _BUILT + "sorted_chain", (SortedOptions, DraftVocabOptions, LookupOptions),
                    needs_draft_model=True),
        DrafterInfo("sorted-tree", _BUILT + "sorted_tree", (SortedOptions, DraftVocabOptions, TreeOptions,
                                                             LookupOptions), needs_draft_model=True, tree=True)):
    register(_info)
