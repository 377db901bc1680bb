"""Drafters, built by name from the registry (registry.py): a new drafter registers there and nowhere else."""

from __future__ import annotations

import importlib

from ..config import SpecConfig
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..registry import DRAFTERS
from .base import Drafter, NoDrafter
from .builders import require_head
from .eagle import EagleDrafter, EagleTreeDrafter
from .lookup_first import LookupFirstDrafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .sorted import SortedDrafter, SortedTreeDrafter
from .tree import PromptLookupTreeDrafter, TreeDrafter


def needs_draft_model(method: str) -> bool:
    return method in DRAFTERS and DRAFTERS[method].needs_draft_model


def check_drafter_inputs(spec: SpecConfig) -> None:
    """The checks a drafter's inputs allow before any model loads (a missing head or head folder)."""
    if DRAFTERS[spec.method].needs_head:
        from .eagle_head import resolve_head_path

        resolve_head_path(require_head(spec))


def build_drafter(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    info = DRAFTERS[spec.method]
    build = info.tree_build if spec.tree else info.build
    if isinstance(build, str):
        module, _, function = build.partition(":")
        build = getattr(importlib.import_module(module), function)
    drafter = build(spec, target, draft)
    if spec.lookup_first_ngram:
        drafter = LookupFirstDrafter(drafter, spec.setting("lookup_max_ngram"), spec.lookup_first_ngram)
    return drafter


__all__ = [
    "Drafter",
    "EagleDrafter",
    "EagleTreeDrafter",
    "LookupFirstDrafter",
    "ModelDrafter",
    "NoDrafter",
    "PromptLookupDrafter",
    "PromptLookupTreeDrafter",
    "SortedDrafter",
    "SortedTreeDrafter",
    "TreeDrafter",
    "build_drafter",
    "check_drafter_inputs",
    "needs_draft_model",
]
