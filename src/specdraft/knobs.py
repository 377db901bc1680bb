"""The drafters' settings on the command line, shared by `generate`, `serve` and `bench`: one flag per setting
that a drafter declares in the registry (registry.py), mapped onto SpecConfig's `options`."""

from __future__ import annotations

import argparse
from typing import Any

from .config import SpecConfig
from .registry import default_of, option_fields, parse_draft_vocab, parse_gamma, parse_lookup_first

__all__ = ["add_drafter_knob_args", "drafter_knobs", "parse_draft_vocab", "parse_gamma", "parse_lookup_first",
           "parse_setting", "setting_kind"]

# SpecConfig's own settings that are no one drafter's: their parsers and what they take
GENERIC_KNOBS = {"gamma": (parse_gamma, "a draft length or auto"),
                 "lookup_first": (parse_lookup_first, "an n-gram length or auto")}
KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "values"}


def _parser_of(name: str):
    """text -> value for a drafter setting (or gamma, lookup_first)."""
    if name in GENERIC_KNOBS:
        return GENERIC_KNOBS[name][0]
    f = option_fields()[name]
    if f.metadata.get("parse"):
        return f.metadata["parse"]
    default = default_of(f)
    if isinstance(default, bool):
        return lambda text: text.strip().lower() in ("1", "true", "yes")
    if isinstance(default, (int, float)):
        return type(default)
    return str


def setting_kind(name: str) -> str:
    """What a setting takes, for error messages."""
    if name in GENERIC_KNOBS:
        return GENERIC_KNOBS[name][1]
    f = option_fields()[name]
    return f.metadata.get("kind") or KINDS.get(type(default_of(f)), "a value")


def parse_setting(name: str, text: str) -> Any:
    """A setting's value from its text; ValueError or argparse.ArgumentTypeError when it does not parse."""
    return _parser_of(name)(text)


def add_drafter_knob_args(parser: argparse.ArgumentParser) -> None:
    """--lookup-first and one flag per registered drafter setting (its default: the options dataclass's)."""
    defaults = SpecConfig()
    parser.add_argument("--lookup-first", type=parse_lookup_first, default=defaults.lookup_first, metavar="N|auto",
                        help="model and head drafters: draft by prompt lookup where the context's last N or more "
                        "tokens occurred earlier, by the drafter elsewhere (0: off; auto, the default: 2 for "
                        "model and head drafters, off for ar and prompt lookup; exact either way)")
    for name, f in option_fields().items():
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        default = default_of(f)
        parser.add_argument(flag, dest=name, type=_parser_of(name), default=default, metavar=f.metadata.get("metavar"),
                            help=f.metadata.get("help", ""))


def drafter_knobs(args: argparse.Namespace) -> dict:
    """The parsed settings as SpecConfig keyword arguments: lookup_first, and every drafter setting in `options`."""
    return {"lookup_first": args.lookup_first, "options": {name: getattr(args, name) for name in option_fields()}}
