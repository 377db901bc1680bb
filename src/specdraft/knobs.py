"""The drafters' own command-line knobs (token trees, sorted exits), shared by `generate`, `serve` and `bench`:
one definition of each flag, mapped onto the SpecConfig fields of the same names."""

from __future__ import annotations

import argparse

from .config import SpecConfig, parse_int_list


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


# SpecConfig fields whose value may be "auto" (None), with their parsers and what they take
AUTO_KNOBS = {"gamma": (parse_gamma, "draft length or auto"),
              "draft_vocab": (parse_draft_vocab, "row count or auto"),
              "lookup_first": (parse_lookup_first, "n-gram length or auto")}


def add_drafter_knob_args(parser: argparse.ArgumentParser) -> None:
    defaults = SpecConfig()
    parser.add_argument("--tree-budget", type=int, default=defaults.tree_budget,
                        help="tree methods: draft nodes per target pass (the verify pass covers budget + 1 tokens)")
    parser.add_argument("--tree-depth", type=int, default=defaults.tree_depth, help="tree methods: levels at most")
    parser.add_argument("--tree-branch", type=int, default=defaults.tree_branch,
                        help="tree methods: most likely children tried per expanded node")
    parser.add_argument("--exits", default="", help="method sorted: the draft's exits as layer counts, e.g. 12,18,24 "
                        "(default: half, three quarters and all of its layers)")
    parser.add_argument("--sorted-draft", default=defaults.sorted_draft, help="method sorted: trained exit "
                        "adapters by name or folder (auto: the shipped ones for the draft model, if any; none: "
                        "bare exits)")
    parser.add_argument("--draft-vocab", type=parse_draft_vocab, default=defaults.draft_vocab, metavar="N|auto",
                        help="methods draft and sorted: score only the N most frequent rows of the draft's LM "
                        "head, plus the prompt's tokens (0: all; auto, the default: 32768 on the native backend, "
                        "all on transformers; exact either way)")
    parser.add_argument("--lookup-first", type=parse_lookup_first, default=defaults.lookup_first, metavar="N|auto",
                        help="model and head drafters: draft by prompt lookup where the context's last N or more "
                        "tokens occurred earlier, by the drafter elsewhere (0: off; auto, the default: 2 for "
                        "model and head drafters, off for ar and prompt lookup; exact either way)")
    parser.add_argument("--exit-rule", default=defaults.exit_rule, help="method sorted: threshold:T1,T2,.. (stop at "
                        "the first exit whose top-1 probability > Ti), probe:T1,T2,.. (stop where the trained "
                        "exit probe's probability > Ti; the LM head runs once per token), cost:W (stop where "
                        "1 - top-1 <= W x the remaining layers' bytes over the target's) or cost-probe:W (the "
                        "same on the probe's probability)")


def drafter_knobs(args: argparse.Namespace) -> dict:
    """The parsed knobs as SpecConfig keyword arguments."""
    return dict(tree_budget=args.tree_budget, tree_depth=args.tree_depth, tree_branch=args.tree_branch,
                sorted_exits=parse_int_list(args.exits, "--exits"), exit_rule=args.exit_rule,
                sorted_draft=args.sorted_draft, draft_vocab=args.draft_vocab, lookup_first=args.lookup_first)
