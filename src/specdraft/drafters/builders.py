"""How each built-in drafter is built from a SpecConfig (registry.py names these functions): (spec, target, draft
model or None) -> Drafter."""

from __future__ import annotations

from ..config import SpecConfig
from ..errors import SpecdraftError
from ..models.adapter import LoadedModel
from ..registry import DraftModelOptions, DraftVocabOptions, EagleOptions, LookupOptions, SortedOptions, TreeOptions
from .base import Drafter, NoDrafter
from .eagle import EagleDrafter, EagleTreeDrafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .sorted import SortedDrafter, SortedTreeDrafter
from .tree import PromptLookupTreeDrafter, TreeDrafter


def require_draft(draft: LoadedModel | None, method: str) -> LoadedModel:
    if draft is None:
        raise SpecdraftError(f"method {method!r} needs a draft model (--draft NAME_OR_PATH)")
    return draft


def require_head(spec: SpecConfig) -> str:
    head = spec.drafter_options(EagleOptions).eagle_head
    if not head:
        raise SpecdraftError(f"method {spec.name!r} needs a trained head (--eagle-head NAME_OR_PATH); train one "
                             "with `specdraft train eagle --out NAME`")
    return head


def _tree(spec: SpecConfig) -> dict:
    tree = spec.drafter_options(TreeOptions)
    return dict(budget=tree.tree_budget, depth=tree.tree_depth, branch=tree.tree_branch)


def plain(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    return NoDrafter()


def prompt_lookup(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    lookup = spec.drafter_options(LookupOptions)
    return PromptLookupDrafter(lookup.lookup_max_ngram, lookup.lookup_min_ngram)


def draft_model(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    options = spec.drafter_options(DraftModelOptions)
    return ModelDrafter(require_draft(draft, spec.name), target, options.draft_confidence,
                        spec.drafter_options(DraftVocabOptions).draft_vocab, options.draft_context)


def draft_tree(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    tree, options, vocab = _tree(spec), spec.drafter_options(DraftModelOptions), spec.drafter_options(DraftVocabOptions)
    return TreeDrafter(require_draft(draft, spec.name), target, tree["budget"], tree["depth"], tree["branch"],
                       options.draft_context, options.draft_confidence, vocab.draft_vocab)


def prompt_lookup_tree(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    tree, lookup = _tree(spec), spec.drafter_options(LookupOptions)
    return PromptLookupTreeDrafter(tree["budget"], tree["depth"], lookup.lookup_max_ngram, lookup.lookup_min_ngram)


def eagle(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    return EagleDrafter.load(require_head(spec), target)


def eagle_tree(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    tree = _tree(spec)
    return EagleTreeDrafter.load_tree(require_head(spec), target, tree["budget"], tree["depth"], tree["branch"])


def _sorted_args(spec: SpecConfig) -> tuple:
    options = spec.drafter_options(SortedOptions)
    return (options.sorted_exits, options.exit_rule, options.sorted_draft,
            spec.drafter_options(DraftVocabOptions).draft_vocab)


def sorted_chain(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    return SortedDrafter.build(require_draft(draft, spec.name), target, *_sorted_args(spec))


def sorted_tree(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    return SortedTreeDrafter.build(require_draft(draft, spec.name), target, *_sorted_args(spec), **_tree(spec))
