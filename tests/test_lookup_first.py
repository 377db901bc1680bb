"""Prompt lookup in front of another drafter (drafters/lookup_first.py): greedy equality for every kind of inner
drafter, exact sampling with a negative control, the statistics' labels, and the configuration's errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

import torch

from specdraft import Engine, SamplingParams, SpecConfig
from specdraft.config import AUTO_GAMMA_MAX, AUTO_LOOKUP_FIRST
from specdraft.draft_length import VerifyCurve
from specdraft.registry import DRAFTERS, method_names

from specdraft.drafters import (
    EagleDrafter,
    EagleTreeDrafter,
    LookupFirstDrafter,
    ModelDrafter,
    SortedDrafter,
    SortedTreeDrafter,
    TreeDrafter,
    build_drafter,
)
from specdraft.drafters.lookup_first import with_copy_branch
from specdraft.types import Draft
from specdraft.errors import SpecdraftError
from test_draft_vocab import models  # noqa: F401  (fixture: a tiny target, a 1-layer and a 4-layer draft)
from test_eagle import tiny_head
from test_exactness import N_SAMPLES, P_THRESHOLD, SETTINGS, engine_pvalue

GREEDY = SamplingParams(max_new_tokens=40)


INNER = {
    "draft": (lambda t, d, s: ModelDrafter(d, t), SpecConfig("draft", 3)),
    "draft-tree": (lambda t, d, s: TreeDrafter(d, t, 6, 3, 2), SpecConfig("draft-tree", tree_budget=6, tree_depth=3)),
    "eagle": (lambda t, d, s: EagleDrafter(tiny_head(t, draft_vocab=4), t), SpecConfig("eagle", 3, eagle_head="mem")),
    "sorted": (lambda t, d, s: SortedDrafter.build(s, t, (1, 2, 4), "threshold:0.5", "none"), SpecConfig("sorted", 3)),
    "eagle-tree": (lambda t, d, s: EagleTreeDrafter(tiny_head(t, draft_vocab=4), t, 6, 3, 2),
                   SpecConfig("eagle-tree", tree_budget=6, tree_depth=3, eagle_head="mem")),
    "sorted-tree": (lambda t, d, s: SortedTreeDrafter.build(s, t, (1, 2, 4), "threshold:0.5", "none", budget=6,
                                                            depth=3, branch=2),
                    SpecConfig("sorted-tree", tree_budget=6, tree_depth=3)),
}


@pytest.mark.parametrize("inner_name", list(INNER))
def test_greedy_with_lookup_first_equals_autoregressive_for_every_inner_drafter(models, inner_name):
    target, draft, deep = models
    make_inner, spec = INNER[inner_name]
    prompt = target.tokenizer("abcabdabcab", add_special_tokens=False)["input_ids"]  # repeats: lookup has matches
    expected = Engine(target).generate(prompt, GREEDY)
    drafter = LookupFirstDrafter(make_inner(target, draft, deep), max_ngram=3, min_ngram=3)
    got = Engine(target, drafter, spec).generate(prompt, GREEDY)
    assert got.token_ids == expected.token_ids
    drafted_by = got.stats.drafter["drafted_by"]
    assert drafted_by.get("lookup", 0) > 0, drafted_by  # both drafters proposed in the same request
    assert sum(v for k, v in drafted_by.items() if k != "lookup") > 0, drafted_by


def test_lookup_first_drafts_a_copy_only_for_long_enough_matches(models):
    target, draft, _ = models
    drafter = LookupFirstDrafter(ModelDrafter(draft, target), max_ngram=3, min_ngram=2)
    drafter.begin([2, 3, 4, 5, 2, 3])
    copy = drafter.propose([2, 3, 4, 5, 2, 3], 2, GREEDY, None)  # "2 3" occurred before: copy what followed
    assert copy.token_ids.tolist() == [4, 5] and copy.labels == ["lookup", "lookup"] and copy.draft_probs is None
    drafter.begin([2, 3, 4, 5, 6, 3])
    own = drafter.propose([2, 3, 4, 5, 6, 3], 2, GREEDY, None)  # only "3" repeats, shorter than min_ngram 2
    assert own.labels == ["draft"] * own.k and own.k == 2


@pytest.mark.parametrize("name", ["T=1", "T=0.7,top-k=3"])
def test_sampling_with_lookup_first_follows_the_target(models, name):
    """N = 1500 generations, chi-square on the first two tokens, pass if p > 1e-3 (test_exactness). From the
    prompt "abc" the second pass copies whenever the first token repeats a prompt token (n-grams from 1)."""
    target, draft, _ = models
    drafter = LookupFirstDrafter(ModelDrafter(draft, target), max_ngram=3, min_ngram=1)
    pvalue = engine_pvalue(target, draft, SETTINGS[name], drafter=drafter, spec=SpecConfig("draft", 3))
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


class BorrowedProbsDrafter(LookupFirstDrafter):
    """Deliberately wrong: a copy is sent with the inner drafter's q (as if the model had sampled it), not as the
    deterministic choice it is."""

    def propose(self, context_ids, k, params, generator):
        own = self.inner.propose(context_ids, k, params, generator)
        draft = super().propose(context_ids, k, params, generator)
        if draft.labels and draft.labels[0] == "lookup" and own.draft_probs is not None:
            n = min(draft.k, own.k)
            draft = replace(draft, token_ids=draft.token_ids[:n], draft_probs=own.draft_probs[:n], labels=None)
        return draft


def test_negative_control_a_copy_with_the_wrong_q_fails_the_same_test(models):
    target, draft, _ = models
    drafter = BorrowedProbsDrafter(ModelDrafter(draft, target), max_ngram=3, min_ngram=1)
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], drafter=drafter, spec=SpecConfig("draft", 3))
    assert pvalue < P_THRESHOLD, f"the wrong drafter passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_lookup_first_is_built_from_the_config_and_refused_where_it_has_nothing_to_wrap(models):
    target, draft, _ = models
    drafter = build_drafter(SpecConfig("draft", lookup_first=2), target, draft)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.min_ngram == 2 and drafter.name == "draft+lookup"
    assert not isinstance(build_drafter(SpecConfig("draft", lookup_first=0), target, draft), LookupFirstDrafter)
    for method in ("ar", "prompt-lookup", "prompt-lookup-tree"):
        with pytest.raises(SpecdraftError, match="has none to fall back on"):
            SpecConfig(method, lookup_first=1)
        assert SpecConfig(method, lookup_first=0).lookup_first_ngram == 0
    with pytest.raises(SpecdraftError, match="lookup_first must be between 0"):
        SpecConfig("draft", lookup_first=4)  # above lookup_max_ngram 3


def test_lookup_first_auto_wraps_model_and_head_drafters_only(models):
    target, draft, _ = models
    assert [m for m, info in DRAFTERS.items() if not info.lookup_first] == ["ar", "prompt-lookup"]
    for method in method_names():  # the tree spellings too ("prompt-lookup-tree": no)
        spec = SpecConfig(method)  # lookup_first None: auto
        expected = AUTO_LOOKUP_FIRST if DRAFTERS[spec.method].lookup_first else 0
        assert spec.lookup_first_ngram == expected, method
    assert SpecConfig("draft", lookup_max_ngram=1, lookup_min_ngram=1).lookup_first_ngram == 0  # no pair to match
    assert isinstance(build_drafter(SpecConfig("draft"), target, draft), LookupFirstDrafter)
    assert isinstance(build_drafter(SpecConfig("draft-tree"), target, draft), LookupFirstDrafter)
    assert not isinstance(build_drafter(SpecConfig("prompt-lookup"), target, draft), LookupFirstDrafter)
    engine = Engine(target, build_drafter(SpecConfig("draft"), target, draft), SpecConfig("draft"),
                    curve=VerifyCurve.flat([1.0] * (AUTO_GAMMA_MAX + 1)))
    result = engine.generate(target.tokenizer.encode("abc abc abc"), SamplingParams(max_new_tokens=4))
    assert result.stats.drafter["lookup_first"] == AUTO_LOOKUP_FIRST


def test_lookup_first_passes_the_feature_taps_of_an_eagle_head_through(models):
    target, _, _ = models
    inner = EagleDrafter(tiny_head(target, draft_vocab=4), target)
    wrapped = LookupFirstDrafter(inner, 3, 2)
    assert wrapped.feature_layers == inner.feature_layers
    assert wrapped.statistics() == {"draft_backend": "eagle-head", "lookup_first": 2}


def _tree(tokens, parents, label):
    return Draft(torch.tensor(tokens), None, torch.tensor(parents), [label] * len(tokens))


def test_a_copy_is_the_first_branch_of_a_tree_and_shared_prefixes_merge():
    copy = Draft(torch.tensor([4, 5, 6]), labels=["lookup"] * 3)
    tree = _tree([4, 7, 5, 8], [-1, -1, 0, 0], "head")  # 4 -> {5, 8}, 7
    merged = with_copy_branch(copy, tree, budget=5)
    assert merged.token_ids.tolist() == [4, 5, 6, 7, 8] and merged.parents.tolist() == [-1, 0, 1, -1, 0]
    assert merged.labels == ["lookup"] * 3 + ["head"] * 2 and merged.draft_probs is None
    smaller = with_copy_branch(copy, tree, budget=4)  # the tree's later node does not fit
    assert smaller.token_ids.tolist() == [4, 5, 6, 7]
    orphans = with_copy_branch(Draft(torch.tensor([4]), labels=["lookup"]), _tree([9, 10], [-1, 0], "head"), 1)
    assert orphans.token_ids.tolist() == [4]  # 9 does not fit, so its child 10 is dropped too


def test_a_tree_drafter_keeps_drafting_beside_a_copy(models):
    target, draft, _ = models
    drafter = LookupFirstDrafter(TreeDrafter(draft, target, 4, 3, 2), max_ngram=3, min_ngram=2)
    context = [2, 3, 4, 5, 2, 3]
    drafter.begin(context)
    got = drafter.propose(context, 3, GREEDY, None)  # "2 3" repeats: the copy [4, 5, 2] leads the tree
    assert got.token_ids.tolist()[:3] == [4, 5, 2] and got.labels[:3] == ["lookup"] * 3
    assert got.parents is not None and 3 <= got.k <= 4


def _lookup_tree_engine_pvalue(target, draft, name, rule=None):
    from specdraft.acceptance import accept_tree_rejection
    from test_exactness import engine_chi_square_pvalue

    spec = SpecConfig("draft-tree", tree_budget=5, tree_depth=3, tree_branch=2)
    drafter = LookupFirstDrafter(TreeDrafter(draft, target, 5, 3, 2), max_ngram=3, min_ngram=1)
    engine = Engine(target, drafter, spec, tree_sampling_rule=rule or accept_tree_rejection)
    return engine_chi_square_pvalue(engine, target, SETTINGS[name], N_SAMPLES)


def test_sampling_with_a_copy_branch_in_a_tree_follows_the_target(models):
    """From "abc", every pass after the first has a copy (n-grams from 1) merged into the draft model's tree."""
    target, draft, _ = models
    pvalue = _lookup_tree_engine_pvalue(target, draft, "T=1")
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_negative_control_the_merged_tree_with_a_wrong_rule_fails_the_same_test(models):
    from test_tree import no_residual_update

    target, draft, _ = models
    pvalue = _lookup_tree_engine_pvalue(target, draft, "T=1", rule=no_residual_update)
    assert pvalue < P_THRESHOLD, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_SAMPLES}"

