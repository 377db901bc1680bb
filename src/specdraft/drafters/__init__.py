"""Drafters, built by name from one registry: a new drafter joins here and nowhere else."""

from __future__ import annotations

from collections.abc import Callable

from ..config import SpecConfig
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from .base import Drafter, NoDrafter
from .eagle import EagleDrafter, EagleTreeDrafter
from .lookup_first import LookupFirstDrafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .sorted import SortedDrafter, SortedTreeDrafter
from .tree import PromptLookupTreeDrafter, TreeDrafter

# Each builder takes (spec, target, draft model or None) and returns a drafter.
DRAFTERS: dict[str, Callable[[SpecConfig, LoadedModel, LoadedModel | None], Drafter]] = {
    "ar": lambda spec, target, draft: NoDrafter(),
    "prompt-lookup": lambda spec, target, draft: PromptLookupDrafter(spec.lookup_max_ngram, spec.lookup_min_ngram),
    "draft": lambda spec, target, draft: ModelDrafter(_require(draft), target, spec.draft_confidence,
                                                            spec.draft_vocab),
    "draft-tree": lambda spec, target, draft: TreeDrafter(_require(draft, "draft-tree"), target, spec.tree_budget,
                                                          spec.tree_depth, spec.tree_branch),
    "prompt-lookup-tree": lambda spec, target, draft: PromptLookupTreeDrafter(
        spec.tree_budget, spec.tree_depth, spec.lookup_max_ngram, spec.lookup_min_ngram),
    "eagle": lambda spec, target, draft: EagleDrafter.load(_require_head(spec), target),
    "eagle-tree": lambda spec, target, draft: EagleTreeDrafter.load_tree(
        _require_head(spec), target, spec.tree_budget, spec.tree_depth, spec.tree_branch),
    "sorted": lambda spec, target, draft: SortedDrafter.build(_require(draft, "sorted"), target, spec.sorted_exits,
                                                              spec.exit_rule, spec.sorted_draft, spec.draft_vocab),
    "sorted-tree": lambda spec, target, draft: SortedTreeDrafter.build(
        _require(draft, "sorted-tree"), target, spec.sorted_exits, spec.exit_rule, spec.sorted_draft, spec.draft_vocab,
        budget=spec.tree_budget, depth=spec.tree_depth, branch=spec.tree_branch),
}

NEEDS_DRAFT_MODEL = {"draft", "draft-tree", "sorted", "sorted-tree"}
NEEDS_EAGLE_HEAD = {"eagle", "eagle-tree"}


def check_drafter_inputs(spec: SpecConfig) -> None:
    """The checks a drafter's inputs allow before any model loads (a missing head or head folder)."""
    if spec.method in NEEDS_EAGLE_HEAD:
        from ..models.eagle_head import resolve_head_path

        resolve_head_path(_require_head(spec))


def _require(draft: LoadedModel | None, method: str = "draft") -> LoadedModel:
    if draft is None:
        raise SpecdraftError(f"method {method!r} needs a draft model (--draft NAME_OR_PATH)")
    return draft


def _require_head(spec: SpecConfig) -> str:
    if not spec.eagle_head:
        raise SpecdraftError(f"method {spec.method!r} needs a trained head (--eagle-head NAME_OR_PATH); train one "
                             "with `specdraft train eagle --out NAME`")
    return spec.eagle_head


def build_drafter(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    drafter = DRAFTERS[spec.method](spec, target, draft)
    if spec.lookup_first_ngram:
        drafter = LookupFirstDrafter(drafter, spec.lookup_max_ngram, spec.lookup_first_ngram)
    return drafter


__all__ = [
    "DRAFTERS",
    "NEEDS_DRAFT_MODEL",
    "NEEDS_EAGLE_HEAD",
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
]
