"""Prompt lookup in front of another drafter (drafters/lookup_first.py): greedy equality for every kind of inner
drafter, exact sampling with a negative control, the statistics' labels, and the configuration's errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

import torch

from specdraft import Engine, SamplingParams, SpecConfig
from specdraft.config import AUTO_LOOKUP_FIRST, METHODS, NO_LOOKUP_FIRST

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
from specdraft.drafters.lookup_first import SHORT_LABEL, with_copy_branch
from specdraft.draft_length import AdaptiveLength, FixedLength, VerifyCurve
from specdraft.types import Draft
from specdraft.errors import SpecdraftError
from test_draft_vocab import models  # noqa: F401  (fixture: a tiny target, a 1-layer and a 4-layer draft)
from test_eagle import tiny_head
from test_exactness import N_SAMPLES, P_THRESHOLD, SETTINGS, engine_chi_square_pvalue, engine_pvalue

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
    drafted_by = got.stats.drafted_by
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


class RatedPolicy:
    """A draft-length policy stand-in that rates sources as told."""

    def __init__(self, rates):
        self.rates = rates

    def rate(self, source=None, context_tokens=0):
        return self.rates[source]


def test_a_short_copy_is_taken_only_where_the_policy_rates_it_above_the_drafter(models):
    """No match of min_ngram tokens, but the last token occurred before: a copy of what followed it competes with
    the drafter by the policy's rates. A long enough match is copied whatever the rates; without a policy that
    rates (fixed gamma), with short copies off, or for a tree drafter, nothing changes."""
    target, draft, deep = models
    context = [2, 3, 4, 5, 6, 3]  # only "3" repeats: a short copy would be [4, 5, 6, 3]
    drafter = LookupFirstDrafter(ModelDrafter(draft, target), max_ngram=3, min_ngram=2, short_copies=True)
    assert drafter.source_bytes == {"lookup": 0, SHORT_LABEL: 0}
    for rates, source in [({SHORT_LABEL: 1.4, None: 1.2}, SHORT_LABEL), ({SHORT_LABEL: 1.1, None: 1.2}, None)]:
        drafter.use_draft_length(RatedPolicy(rates))
        drafter.begin(context)
        assert drafter.next_source(context) == source
        proposed = drafter.propose(context, 2, GREEDY, None)
        if source == SHORT_LABEL:
            assert proposed.token_ids.tolist() == [4, 5] and proposed.labels == [SHORT_LABEL] * 2
            assert proposed.draft_probs is None
        else:
            assert proposed.labels == ["draft"] * proposed.k
    long_match = [2, 3, 4, 5, 2, 3]
    drafter.begin(long_match)
    assert drafter.next_source(long_match) == "lookup"  # rated below the drafter, but a pair repeats
    drafter.use_draft_length(None)  # the request ended
    drafter.begin(context)
    assert drafter.next_source(context) is None
    drafter.use_draft_length(FixedLength(3))  # a fixed gamma does not rate sources
    assert drafter.policy is None and drafter.next_source(context) is None
    off = LookupFirstDrafter(ModelDrafter(draft, target), max_ngram=3, min_ngram=2)
    off.use_draft_length(RatedPolicy({SHORT_LABEL: 9.0, None: 1.0}))
    off.begin(context)
    assert off.next_source(context) is None and off.source_bytes == {"lookup": 0}
    tree = LookupFirstDrafter(TreeDrafter(draft, target, 6, 3, 2), max_ngram=3, min_ngram=2, short_copies=True)
    assert not tree.short_copies


def test_lookup_first_auto_weighs_short_copies_and_a_set_ngram_does_not(models):
    target, draft, _ = models
    assert build_drafter(SpecConfig("draft"), target, draft).short_copies
    assert not build_drafter(SpecConfig("draft", lookup_first=2), target, draft).short_copies


def _short_copy_engine(target, draft, drafter_class=LookupFirstDrafter, **rule):
    """Gamma auto on a flat curve, the tiny draft priced as a real one (0.3 of the target): short copies (free,
    never tried: the prior) rate above the drafter at first, below it after they miss, so which of the two drafts
    the second token's pass follows from the first pass's outcome."""
    drafter = drafter_class(ModelDrafter(draft, target), max_ngram=3, min_ngram=2, short_copies=True)
    engine = Engine(target, drafter, SpecConfig("draft", None), **rule)
    engine.curve = VerifyCurve.flat(1.0 + 0.08 * n for n in range(9))
    drafter.inner.draft_bytes = 0.3 * engine.target_bytes
    return engine


def test_greedy_with_short_copies_equals_autoregressive_and_takes_them(models):
    target, draft, _ = models
    engine = _short_copy_engine(target, draft)
    assert isinstance(engine.new_draft_length(), AdaptiveLength)
    taken = 0
    for prompt in ["abcabdabcab", "dcba edcba", "aebcd"]:
        ids = target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == Engine(target).generate(ids, GREEDY).token_ids, prompt
        taken += got.stats.drafted_by.get(SHORT_LABEL, 0)
    assert taken > 0
    assert engine.drafter.policy is None  # let go when each request ended


@pytest.mark.parametrize("name", ["T=1"])
def test_sampling_with_short_copies_follows_the_target(models, name):
    """The statistical suite's test with short copies weighed pass by pass (the prompt "abc": the second pass
    may copy after a repeated single token); a copy sent with the drafter's q must fail it."""
    target, draft, _ = models
    engine = _short_copy_engine(target, draft)
    params = SamplingParams(**{**SETTINGS[name].__dict__, "max_new_tokens": 6})
    assert engine_chi_square_pvalue(engine, target, params, N_SAMPLES) > P_THRESHOLD
    wrong = _short_copy_engine(target, draft, ShortBorrowedProbsDrafter)
    assert engine_chi_square_pvalue(wrong, target, params, N_SAMPLES) < P_THRESHOLD


class ShortBorrowedProbsDrafter(LookupFirstDrafter):
    """Deliberately wrong: a short copy is sent with the inner drafter's q, as if the model had sampled it."""

    def propose(self, context_ids, k, params, generator):
        draft = super().propose(context_ids, k, params, generator)
        if draft.labels and draft.labels[0] == SHORT_LABEL:
            own = self.inner.propose(context_ids, k, params, generator)
            n = min(draft.k, own.k)
            if own.draft_probs is not None and n:
                draft = replace(draft, token_ids=draft.token_ids[:n], draft_probs=own.draft_probs[:n], labels=None)
        return draft


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
    for method in METHODS:
        spec = SpecConfig(method)  # lookup_first None: auto
        expected = 0 if method in NO_LOOKUP_FIRST else AUTO_LOOKUP_FIRST
        assert spec.lookup_first_ngram == expected, method
    assert SpecConfig("draft", lookup_max_ngram=1, lookup_min_ngram=1).lookup_first_ngram == 0  # no pair to match
    assert isinstance(build_drafter(SpecConfig("draft"), target, draft), LookupFirstDrafter)
    assert isinstance(build_drafter(SpecConfig("draft-tree"), target, draft), LookupFirstDrafter)
    assert not isinstance(build_drafter(SpecConfig("prompt-lookup"), target, draft), LookupFirstDrafter)
    engine = Engine(target, build_drafter(SpecConfig("draft"), target, draft), SpecConfig("draft"))
    result = engine.generate(target.tokenizer.encode("abc abc abc"), SamplingParams(max_new_tokens=4))
    assert result.stats.lookup_first == AUTO_LOOKUP_FIRST


def test_lookup_first_passes_the_feature_taps_of_an_eagle_head_through(models):
    target, _, _ = models
    inner = EagleDrafter(tiny_head(target, draft_vocab=4), target)
    wrapped = LookupFirstDrafter(inner, 3, 2)
    assert wrapped.feature_layers == inner.feature_layers and wrapped.backend == "eagle-head"


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

