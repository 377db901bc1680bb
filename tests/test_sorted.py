"""S2D sorted drafting: each exit drafts from exactly its sub-model, the loop stays lossless, the rules, errors."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from specdraft import Engine, ModelConfig, SamplingParams, SpecConfig, load_engine, load_model
from specdraft.registry import parse_exit_rule
from specdraft.drafters import SortedDrafter, SortedTreeDrafter, build_drafter
from specdraft.drafters.sorted import CostAwareExit, LayeredState, ThresholdExit
from specdraft.errors import SpecdraftError
from specdraft.models.native.llama import NativeLlama
from test_exactness import N_SAMPLES, P_THRESHOLD, PROMPT, SETTINGS, engine_pvalue
from tiny import build_model


@pytest.fixture(scope="module")
def sorted_models(tmp_path_factory):
    """A tiny target and a 4-layer tiny draft (exits 1, 2, 4), native, in float32 and bf16 weights."""
    root = tmp_path_factory.mktemp("sorted")
    target_dir = build_model(root / "target", seed=21, chars="abcde", init_range=0.5)
    draft_dir = build_model(root / "draft", seed=22, chars="abcde", init_range=0.5, layers=4)
    return {dtype: (load_model(str(target_dir), dtype, backend="native"),
                    load_model(str(draft_dir), dtype, backend="native")) for dtype in ("float32", "bfloat16")}


def sub_model_logits(draft, depth: int, token_ids: list[int]) -> torch.Tensor:
    """The reference: the draft cut to its first `depth` layers, run alone over the whole sequence: [1, V]."""
    cut = copy.deepcopy(draft.transformers_model("a cut copy"))
    cut.model.layers = cut.model.layers[:depth]
    cut.config.num_hidden_layers = depth
    native = NativeLlama(cut, panels=True)  # as load_model builds the draft's: the same kernels
    return native.forward(token_ids, native.new_cache(), 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_exit_equals_its_sub_model_run_alone_bit_for_bit(sorted_models, dtype):
    _, draft = sorted_models[dtype]
    rng = random.Random(0)
    state = LayeredState(draft.native, capacity=4)  # small: the cache and residual rows must grow
    tokens: list[int] = []
    with torch.inference_mode():
        for step in range(24):
            if step in (9, 17):  # roll back a few positions, as a rejected draft does
                keep = len(tokens) - 3
                state.truncate(keep)
                del tokens[keep:]
            token = rng.randrange(2, 7)
            tokens.append(token)
            state.append([token])
            for depth in sorted(rng.sample([1, 2, 4], rng.randint(1, 3))):  # exits tried in order, as drafting does
                state.run_to(depth)
                assert torch.equal(draft.native.logits(state.last_residual()), sub_model_logits(draft, depth, tokens)), (step, depth)


def test_negative_control_skipping_the_fill_of_deeper_layers_is_detected(sorted_models):
    _, draft = sorted_models["float32"]
    state = LayeredState(draft.native)
    tokens = [2, 3, 4, 5]
    with torch.inference_mode():
        state.append(tokens[:3])
        state.run_to(1)  # the first three positions stop at exit 1
        state.append(tokens[3:])
        state.layer_length[1:] = [4] * 3  # pretend layers 1..3 hold the earlier positions: they hold zeros
        state.run_to(4)
        assert not torch.equal(draft.native.logits(state.last_residual()), sub_model_logits(draft, 4, tokens))


def test_filled_depths_never_increase_along_the_sequence(sorted_models):
    _, draft = sorted_models["float32"]
    state = LayeredState(draft.native)
    with torch.inference_mode():
        for token, depth in zip([2, 3, 4, 5, 6, 2], [4, 1, 2, 1, 4, 2]):
            state.append([token])
            state.run_to(depth)
            depths = [state.depth(t) for t in range(len(state))]
            assert depths == sorted(depths, reverse=True) and depths[-1] == depth


@pytest.mark.parametrize("method", ["sorted", "sorted-tree"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rule", ["threshold:0.3,0.6", "cost:2.0"])
def test_greedy_sorted_drafting_is_token_identical_to_plain_decoding(sorted_models, method, dtype, rule):
    target, draft = sorted_models[dtype]
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(target).generate(PROMPT, params).token_ids
    spec = SpecConfig(method, gamma=4, sorted_exits=(1, 2, 4), exit_rule=rule, tree_budget=6, tree_depth=3,
                      sorted_draft="none", lookup_first=0)
    result = Engine(target, build_drafter(spec, target, draft), spec).generate(PROMPT, params)
    assert result.token_ids == plain
    drafted_by, accepted_by = result.stats.drafter["drafted_by"], result.stats.drafter["accepted_by"]
    assert sum(drafted_by.values()) == result.stats.drafted and set(drafted_by) <= {"exit 1", "exit 2", "exit 4"}
    assert sum(accepted_by.values()) == result.stats.accepted
    assert all(accepted_by.get(label, 0) <= n for label, n in drafted_by.items())
    assert result.stats.accepted > 0 and (result.stats.tree_passes > 0) == (method == "sorted-tree")


def sorted_pvalue(target, draft, params, drafter_class=SortedDrafter) -> float:
    drafter = drafter_class(draft, target, (1, 2, 4), ThresholdExit((0.4, 0.6)))
    return engine_pvalue(target, draft, params, drafter=drafter, spec=SpecConfig("sorted", 3))


@pytest.mark.parametrize("method", ["sorted", "sorted-tree"])
@pytest.mark.parametrize("name", ["T=1", "T=0.7,top-k=3"])
def test_sampled_tokens_follow_the_target_distribution(sorted_models, method, name):
    """N = 1500 generations per setting, chi-square on the first two tokens, pass if p > 1e-3 (test_exactness);
    sorted-tree's pvalue is defined with its tests below."""
    target, draft = sorted_models["float32"]
    pvalue = (sorted_pvalue if method == "sorted" else sorted_tree_pvalue)(target, draft, SETTINGS[name])
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


class MislabelledSortedDrafter(SortedDrafter):
    """Deliberately wrong: samples at the chosen exit but reports a uniform q to the acceptance rule."""

    def propose(self, context_ids, k, params, generator):
        draft = super().propose(context_ids, k, params, generator)
        if draft.draft_probs is not None:
            draft.draft_probs = torch.full_like(draft.draft_probs, 1.0 / draft.draft_probs.shape[-1])
        return draft


def test_negative_control_a_mislabelled_exit_distribution_fails_the_same_test(sorted_models):
    target, draft = sorted_models["float32"]
    pvalue = sorted_pvalue(target, draft, SETTINGS["T=1"], MislabelledSortedDrafter)
    assert pvalue < P_THRESHOLD, f"the wrong drafter passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_threshold_rule_stops_at_the_first_confident_exit():
    rule = ThresholdExit((0.5, 0.8))
    assert rule.stop(0, 0.6) and not rule.stop(0, 0.5)
    assert not rule.stop(1, 0.7) and rule.stop(1, 0.9)
    assert rule.stop(2, 0.9)  # exits past the tuple reuse its last threshold


def test_cost_aware_rule_runs_cheap_layers_unless_nearly_sure():
    rule = CostAwareExit(remaining_cost=(0.2, 0.05, 0.0), weight=1.0)
    assert rule.stop(0, 0.85) and not rule.stop(0, 0.75)  # 20 % of a target pass left: stop when >= 80 % sure
    assert rule.stop(1, 0.96) and not rule.stop(1, 0.9)  # 5 % left: go on unless >= 95 % sure


def test_default_exits_are_half_three_quarters_and_all_layers(sorted_models):
    target, draft = sorted_models["float32"]
    drafter = build_drafter(SpecConfig("sorted", lookup_first=0), target, draft)
    assert drafter.exits == (2, 3, 4)


@pytest.mark.parametrize("text", ["threshold", "threshold:1.5", "cost:-1", "cost:1,2", "median:0.5", "cost:x"])
def test_malformed_exit_rules_are_user_errors(text):
    with pytest.raises(SpecdraftError, match="exit rule"):
        parse_exit_rule(text)
    with pytest.raises(SpecdraftError):
        SpecConfig("sorted", exit_rule=text)


def test_bad_exits_and_a_transformers_draft_are_clear_errors(sorted_models, tiny_dirs):
    target, draft = sorted_models["float32"]
    with pytest.raises(SpecdraftError, match="increasing"):
        SpecConfig("sorted", sorted_exits=(4, 2))
    with pytest.raises(SpecdraftError, match="between 1 and 4"):
        build_drafter(SpecConfig("sorted", sorted_exits=(2, 8)), target, draft)
    on_transformers = load_model(str(tiny_dirs["draft"]), "float32", backend="transformers")
    with pytest.raises(SpecdraftError, match="native backend"):
        build_drafter(SpecConfig("sorted"), target, on_transformers)


# ------------------------------------------------------------------------------------- sorted-tree (issue 8)

TREE_TOKENS = [3, 5, 2, 6, 4, 5, 3]
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # two roots; node i attends to its ancestors only


def _branch(node: int) -> list[int]:
    tokens = []
    while node >= 0:
        tokens.append(TREE_TOKENS[node])
        node = TREE_PARENTS[node]
    return tokens[::-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree_depth", [1, 2, 4])
def test_a_tree_at_an_exit_gives_each_node_its_branch_through_that_sub_model(sorted_models, dtype, tree_depth):
    """Tree nodes run through the first `tree_depth` layers only, in two passes (a frontier, then the next);
    each node's row equals the sub-model's logits for its branch run alone, bit for bit. Keeping a path then
    leaves positions of that depth which a deeper exit later fills soundly."""
    _, draft = sorted_models[dtype]
    prompt = [2, 4, 3, 5]
    state = LayeredState(draft.native, capacity=4)
    with torch.inference_mode():
        state.append(prompt)
        state.run_to(tree_depth)
        state.node_layers = tree_depth
        first = state.forward_tree(TREE_TOKENS[:4], TREE_PARENTS[:4], 4)  # [4, D]
        second = state.forward_tree(TREE_TOKENS[4:], TREE_PARENTS[4:], 3)  # [3, D]
        rows = torch.cat([first, second])
        for node in range(len(TREE_TOKENS)):
            expected = sub_model_logits(draft, tree_depth, prompt + _branch(node))
            assert torch.equal(draft.native.logits(rows[node: node + 1]), expected), node
        path = [1, 4, 6]  # 5, 4, 3: not the first branch, so its K/V and residual rows move
        state.keep_tree_path(path)
        kept = prompt + [TREE_TOKENS[n] for n in path]
        assert state.token_ids == kept and [state.depth(t) for t in range(len(kept))][-3:] == [tree_depth] * 3
        state.append([6])
        state.run_to(4)  # the whole draft: the kept nodes' missing layers are filled first
        assert torch.equal(draft.native.logits(state.last_residual()), sub_model_logits(draft, 4, kept + [6]))


def test_negative_control_a_tree_pass_without_its_mask_is_detected(sorted_models):
    _, draft = sorted_models["float32"]
    state = LayeredState(draft.native)
    with torch.inference_mode():
        state.append([2, 4, 3, 5])
        state.run_to(2)
        state.node_layers = 2
        rows = state.forward(TREE_TOKENS[:4], 4)  # the four nodes as a chain: each sees its earlier siblings
    assert not torch.equal(draft.native.logits(rows[3:4]), sub_model_logits(draft, 2, [2, 4, 3, 5] + _branch(3)))


def sorted_tree(target, draft, rule: str = "threshold:0.4,0.6", budget: int = 6, depth: int = 3,
                branch: int = 2) -> tuple[SpecConfig, SortedTreeDrafter]:
    spec = SpecConfig("sorted-tree", tree_budget=budget, tree_depth=depth, tree_branch=branch, sorted_exits=(1, 2, 4),
                      exit_rule=rule, sorted_draft="none", lookup_first=0)
    return spec, build_drafter(spec, target, draft)


def test_sorted_tree_takes_a_reduced_vocabulary(sorted_models):
    """Scores over a subset of the head's rows are spread to the full vocabulary (-inf elsewhere): greedy output
    still equals plain decoding, and every drafted token is a row of the subset or a prompt token."""
    target, draft = sorted_models["float32"]
    params = SamplingParams(max_new_tokens=16)
    plain = Engine(target).generate(PROMPT, params).token_ids
    spec = SpecConfig("sorted-tree", tree_budget=5, tree_depth=3, sorted_exits=(1, 2, 4), sorted_draft="none",
                      draft_vocab=5, lookup_first=0)
    drafter = build_drafter(spec, target, draft)
    assert drafter.vocab_rows == 5
    assert Engine(target, drafter, spec).generate(PROMPT, params).token_ids == plain


def sorted_tree_pvalue(target, draft, params, tree_rule=None) -> float:
    from specdraft.acceptance import accept_tree_rejection
    from test_exactness import engine_chi_square_pvalue

    spec, drafter = sorted_tree(target, draft, budget=6, depth=3, branch=3)
    engine = Engine(target, drafter, spec, tree_sampling_rule=tree_rule or accept_tree_rejection)
    return engine_chi_square_pvalue(engine, target, params, N_SAMPLES)


def test_sorted_tree_negative_control_fails_the_same_test(sorted_models):
    from test_tree import no_residual_update

    target, draft = sorted_models["float32"]
    pvalue = sorted_tree_pvalue(target, draft, SETTINGS["T=1"], tree_rule=no_residual_update)
    assert pvalue < P_THRESHOLD, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


# ------------------------------------------------------------------------------- self-speculation: shared K/V

def recording(drafter_class):
    """`drafter_class` keeping every proposal's tokens, q rows and tree parents, to compare runs bit for bit."""

    class Recording(drafter_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.proposals: list[tuple[list[int], torch.Tensor | None, torch.Tensor | None]] = []

        def propose(self, context_ids, k, params, generator):
            draft = super().propose(context_ids, k, params, generator)
            self.proposals.append((draft.token_ids.tolist(), draft.draft_probs, draft.parents))
            return draft

    return Recording


def sampled_proposals(target, draft, share: bool, drafter_class=SortedDrafter, seed: int = 3):
    """One sampled generation (T=1) with exits (1, 2, 4) on `target`; the drafter reads the target's cache only
    when `share` (forced on whatever the weights, for the negative control)."""
    drafter = recording(drafter_class)(draft, target, (1, 2, 4), ThresholdExit((0.4, 0.6)))
    drafter.shares_target = share
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=seed)
    result = Engine(target, drafter, SpecConfig(drafter.name, 3)).generate(PROMPT * 5, params)
    return result.token_ids, drafter.proposals


def same_proposals(a, b) -> bool:
    def same(x, y):
        return x is y or (x is not None and y is not None and torch.equal(x, y))

    return len(a) == len(b) and all(tokens_a == tokens_b and same(q_a, q_b) and same(parents_a, parents_b)
                                    for (tokens_a, q_a, parents_a), (tokens_b, q_b, parents_b) in zip(a, b))


@pytest.mark.parametrize("drafter_class", [SortedDrafter, SortedTreeDrafter])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_draft_on_its_own_parent_drafts_the_same_from_the_adopted_cache_bit_for_bit(sorted_models, dtype,
                                                                                    drafter_class):
    _, draft = sorted_models[dtype]
    assert SortedDrafter(draft, draft, (1, 2, 4), ThresholdExit()).shares_target
    shared_tokens, shared = sampled_proposals(draft, draft, True, drafter_class)
    own_tokens, own = sampled_proposals(draft, draft, False, drafter_class)
    assert shared_tokens == own_tokens and len(shared) > 5 and same_proposals(shared, own)


def test_negative_control_adopting_another_models_cache_changes_the_draft(sorted_models, tmp_path):
    _, draft = sorted_models["float32"]
    other = load_model(str(build_model(tmp_path / "other", seed=23, chars="abcde", init_range=0.5, layers=4)),
                       "float32", backend="native")
    assert not SortedDrafter(draft, other, (1, 2, 4), ThresholdExit()).shares_target
    _, adopted = sampled_proposals(other, draft, share=True)
    _, own = sampled_proposals(other, draft, share=False)
    assert not same_proposals(adopted, own)


def counted_layers(native, monkeypatch) -> list[int]:
    """The index of every layer `native` runs from now on: one by one (`layer_forward`, the sorted draft's own
    layers) or all of them in a pass of the whole model (`_layers`)."""
    runs: list[int] = []
    layer_forward, all_layers = native.layer_forward, native._layers
    monkeypatch.setattr(native, "layer_forward", lambda *a, **k: runs.append(a[0]) or layer_forward(*a, **k))
    monkeypatch.setattr(native, "_layers",
                        lambda *a, **k: runs.extend(range(len(native.layers))) or all_layers(*a, **k))
    return runs


def begin_beside_target(drafter, model, prompt, handed_prompt=None):
    """The engine's order: hand over the target's state, prefill the target (over `handed_prompt`, by default
    the same prompt), begin the drafter. Returns the target's state."""
    state = model.new_state(64)
    drafter.use_target_state(state)
    state.forward((handed_prompt or prompt)[:-1], 1)
    drafter.begin(prompt)
    return state


def test_the_shared_prompt_runs_no_draft_layer(sorted_models, monkeypatch):
    _, draft = sorted_models["float32"]
    spec = SpecConfig("sorted", 3, sorted_exits=(1, 2, 4), sorted_draft="none", lookup_first=2)
    drafter = build_drafter(spec, draft, draft)  # lookup first wraps it and passes the target's state on
    runs = counted_layers(draft.native, monkeypatch)
    with torch.inference_mode():
        state = begin_beside_target(drafter, draft, PROMPT * 5)
    assert runs == [0, 1, 2, 3]  # the target's prefill, and no layer of the draft's own
    assert drafter.inner.state.layer_length == [14] * 4
    assert torch.equal(drafter.inner.state.cache.keys[:, :, :14], state.cache.keys[:, :, :14])


def test_a_state_handed_over_for_another_prompt_is_not_adopted(sorted_models, monkeypatch):
    _, draft = sorted_models["float32"]
    drafter = SortedDrafter(draft, draft, (1, 2, 4), ThresholdExit())
    runs = counted_layers(draft.native, monkeypatch)
    with torch.inference_mode():
        begin_beside_target(drafter, draft, PROMPT * 5, handed_prompt=[5, 6] + PROMPT * 4)
    assert drafter.target_state is None and runs == [0, 1, 2, 3] * 2  # the target's prefill, then the draft's own
    reference = draft.new_state(64)
    with torch.inference_mode():
        reference.forward((PROMPT * 5)[:-1], 1)
    assert torch.equal(drafter.state.cache.keys[:, :, :14], reference.cache.keys[:, :, :14])


def test_every_accepted_token_is_adopted_at_every_depth(sorted_models):
    _, draft = sorted_models["float32"]
    depths_after_each_pass = []

    class Watching(SortedDrafter):
        def on_accept(self, context_ids, features=None):
            super().on_accept(context_ids, features)
            depths_after_each_pass.append((list(self.state.layer_length), len(context_ids) - 1))

    drafter = Watching(draft, draft, (1, 2, 4), ThresholdExit((0.4, 0.6)))
    Engine(draft, drafter, SpecConfig("sorted", 3)).generate(PROMPT * 5, SamplingParams(max_new_tokens=24))
    assert len(depths_after_each_pass) > 3 and drafter.target_state is None  # let go when the request ended
    assert all(lengths == [cached] * 4 for lengths, cached in depths_after_each_pass)


def test_exits_shallower_than_the_target_share_its_first_layers_bit_for_bit(sorted_models, monkeypatch):
    """Exits (1, 2) of the 4-layer model serving the whole model: layers 0-1 adopted, 2-3 never run."""
    _, draft = sorted_models["bfloat16"]
    cut_model = copy.deepcopy(draft.transformers_model("a cut copy"))  # its own tensors, equal to the draft's
    cut_model.model.layers = cut_model.model.layers[:2]
    cut_model.config.num_hidden_layers = 2
    native = NativeLlama(cut_model, panels=True)  # as load_model builds the draft's: the same kernels
    cut = dataclasses.replace(draft, model=None if native.transformers_spent else cut_model, native=native,
                              gguf_config=cut_model.config, gguf_generation_config=cut_model.generation_config)
    assert cut.native.same_first_layers(draft.native, 2) and not cut.native.same_first_layers(draft.native, 4)

    def proposals(share: bool):
        drafter = recording(SortedDrafter)(cut, draft, (1, 2), ThresholdExit((0.5,)))
        assert drafter.shares_target
        drafter.shares_target = share
        params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5)
        Engine(draft, drafter, SpecConfig("sorted", 3)).generate(PROMPT * 5, params)
        return drafter.proposals

    assert same_proposals(proposals(True), proposals(False))


def test_nothing_runs_deeper_than_the_adopted_layers_over_adopted_positions(sorted_models):
    _, draft = sorted_models["float32"]
    target = draft.new_state(64)
    state = LayeredState(draft.native)
    with torch.inference_mode():
        target.forward(PROMPT * 3, 1)
        state.append(PROMPT * 3)
        state.adopt(target.cache, 9, 2)  # residual rows of positions 0-8 are now stale past layer 2
        with pytest.raises(AssertionError, match="stale"):
            state.run_to(4)


def test_shared_drafting_stays_token_identical_to_plain_decoding(sorted_models):
    _, draft = sorted_models["float32"]
    spec = SpecConfig("sorted", 3, sorted_exits=(1, 2, 4), sorted_draft="none", lookup_first=2)
    plain = Engine(draft).generate(PROMPT * 5, SamplingParams(max_new_tokens=24)).token_ids
    shared = Engine(draft, build_drafter(spec, draft, draft), spec)
    assert shared.generate(PROMPT * 5, SamplingParams(max_new_tokens=24)).token_ids == plain


def test_same_first_layers_compares_weights_not_names(sorted_models):
    target, draft = sorted_models["float32"]
    again = load_model(draft.path, "float32", backend="native")  # loaded twice: equal tensors, not the same ones
    assert draft.native.same_first_layers(again.native, 4)
    assert not draft.native.same_first_layers(target.native, 1)  # another model
    assert not draft.native.same_first_layers(sorted_models["bfloat16"][1].native, 4)  # another dtype


def test_a_draft_named_as_the_target_is_loaded_once_and_shares_its_cache(sorted_models):
    _, draft = sorted_models["float32"]
    spec = SpecConfig("sorted", 3, sorted_exits=(1, 2, 4), sorted_draft="none", lookup_first=0)
    engine = load_engine(ModelConfig(target=draft.path, draft=draft.path, dtype="float32", backend="native"), spec,
                         progress=False)
    assert engine.drafter.shares_target and engine.drafter.native is engine.target.native
    plain = Engine(engine.target).generate(PROMPT * 5, SamplingParams(max_new_tokens=24)).token_ids
    assert engine.generate(PROMPT * 5, SamplingParams(max_new_tokens=24)).token_ids == plain
