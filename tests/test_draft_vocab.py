"""Reduced draft vocabularies (drafters/vocab.py) and trained exit adapters (drafters/exit_adapters.py): the rows
drafted from, exactness of greedy and sampled decoding with them (with negative controls), the adapters' identity
at initialisation, loading by name, and their training (train/sorted_train.py) end to end on tiny models."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, load_model
from specdraft.drafters import ModelDrafter, SortedDrafter, build_drafter
from specdraft.drafters.sorted import ThresholdExit
from specdraft.drafters.tree import TreeDrafter
from specdraft.drafters.vocab import DraftVocab, SplitRows
from specdraft.models.native.kernels import load_kernels
from specdraft.errors import SpecdraftError
from specdraft.models.verify_curve import verify_curve
from specdraft.drafters.exit_adapters import (
    AdapterConfig,
    ExitAdapters,
    draft_fingerprint,
    find_shipped,
    load_adapters,
    save_adapters,
)
from test_exactness import N_SAMPLES, P_THRESHOLD, PROMPT, SETTINGS, engine_pvalue
from test_quant import (RELATIVE_TOLERANCE, activation_block, gguf_dequantize, random_blocks, reference_product,
                        relative_error)
from tiny import build_model

SMALL_VOCAB = 3  # rows <unk>, <eos>, a; the prompt "abc" adds b and c; d and e can never be drafted


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target (greedy from PROMPT emits d and e), a 1-layer draft and a 4-layer draft (sorted exits)."""
    root = tmp_path_factory.mktemp("vocab")
    target = load_model(str(build_model(root / "t", seed=21, chars="abcde", init_range=0.5)), "float32",
                        backend="native")
    draft = load_model(str(build_model(root / "d", seed=12, chars="abcde", init_range=0.5, layers=1)), "float32",
                       backend="native")
    deep = load_model(str(build_model(root / "s", seed=22, chars="abcde", init_range=0.5, layers=4)), "float32",
                      backend="native")
    return target, draft, deep


# ------------------------------------------------------------------------------------------------ the rows

def test_rows_are_the_lowest_ids_the_special_tokens_and_the_prompt():
    head = torch.randn(40, 8)
    vocab = DraftVocab(head, size=10, always=(0, 1, 39))
    assert vocab.ids.tolist() == list(range(10)) + [39]
    vocab.for_prompt([3, 12, 25, 12])
    assert vocab.ids.tolist() == list(range(10)) + [12, 25, 39]
    assert torch.equal(vocab.weight, head[vocab.ids])
    probs = torch.softmax(torch.randn(2, len(vocab.ids)), -1)
    full = vocab.spread(probs)  # [2, 40]
    assert full.shape == (2, 40) and torch.allclose(full.sum(-1), torch.ones(2))
    outside = torch.ones(40, dtype=torch.bool)
    outside[vocab.ids] = False
    assert full[:, outside].eq(0).all() and torch.equal(full[:, vocab.ids], probs)
    assert vocab.target_id(10) == 12


def test_each_request_gets_its_own_rows_and_a_long_prompt_grows_the_room():
    """The fixed rows are copied once and a request writes its extra rows after them: a later request with other
    (or more) extra tokens than the room holds must see exactly its own rows, and the fixed rows unchanged."""
    head = torch.randn(1000, 8)
    vocab = DraftVocab(head, size=10, always=(999,))
    vocab.for_prompt(list(range(10, 600)))  # 590 extra rows: more than the room the buffer started with
    assert vocab.ids.tolist() == list(range(600)) + [999]
    assert torch.equal(vocab.weight, head[vocab.ids])
    vocab.for_prompt([5, 700, 12])
    assert vocab.ids.tolist() == list(range(10)) + [12, 700, 999]
    assert torch.equal(vocab.weight, head[vocab.ids])
    with torch.inference_mode():  # the engine's mode: a buffer grown in it is still writable outside it
        vocab.for_prompt(list(range(10, 900)))
    vocab.for_prompt([5, 12])
    assert torch.equal(vocab.weight, head[vocab.ids])


@pytest.mark.skipif(load_kernels() is None, reason="the native kernels cannot be built on this machine")
def test_a_quantized_head_scores_its_fixed_rows_repacked_and_the_prompts_rows_after_them():
    """A GGUF head's fixed rows are kept repacked in groups of 8 (a one-token product reads them at the kernels'
    full speed), a request's extra rows beside them: scored as one matrix, the rows in the vocabulary's order, each
    request with its own extra rows; a head that put the extra rows first must fail the same check."""
    head = random_blocks("Q8_0", 96, 128, seed=5)  # [V, D] in the file's layout
    vocab = DraftVocab(head, size=16, always=(95,))
    vocab.for_prompt([3, 40, 70, 40])
    assert vocab.ids.tolist() == list(range(16)) + [40, 70, 95]
    assert isinstance(vocab.weight, SplitRows) and vocab.weight.fixed.interleaved and vocab.weight.shape == (19, 128)
    assert torch.equal(vocab.weight.dequantize(), head.dequantize(vocab.ids))
    x = torch.randn(3, 128)
    reference = reference_product(x, gguf_dequantize(head)[vocab.ids], activation_block("Q8_0"))  # [3, 19]
    assert relative_error(vocab.weight.linear(x, None), reference) < RELATIVE_TOLERANCE
    swapped = SplitRows(vocab.weight.extra, vocab.weight.fixed)  # negative control: the parts in the wrong order
    assert relative_error(swapped.linear(x, None), reference) > 100 * RELATIVE_TOLERANCE
    alone = torch.cat([vocab.weight.linear(x[t: t + 1], None) for t in range(3)])
    assert torch.equal(vocab.weight.linear(x, None), alone)  # batch-invariant, as a draft step must be
    vocab.for_prompt([5, 60])  # the next request: its own extra rows, the fixed rows kept
    assert vocab.ids.tolist() == list(range(16)) + [60, 95]
    assert torch.equal(vocab.weight.dequantize(), head.dequantize(vocab.ids))
    vocab.for_prompt(list(range(16, 95)))  # more extra rows than the room: the buffer grows
    assert len(vocab.weight) == 96 and torch.equal(vocab.weight.dequantize(), head.dequantize(torch.arange(96)))
    # drafters over one head share one copy of its fixed rows (a server has one per request in flight); a head
    # already repacked lends a view of its first groups; 12 rows are repacked with 4 rows of zeros
    assert DraftVocab(head, size=16).fixed is vocab.fixed
    packed = head.interleave()
    viewed = DraftVocab(packed, size=16)
    assert viewed.fixed.blocks.data_ptr() == packed.blocks.data_ptr()
    assert torch.equal(viewed.weight.dequantize(), head.dequantize(torch.arange(16)))
    uneven = DraftVocab(packed, size=12)
    assert uneven.fixed.padding == 4 and len(uneven.weight) == 12 and len(uneven.weight.extra) == 0
    reference = reference_product(x, gguf_dequantize(head)[:12], activation_block("Q8_0"))
    assert relative_error(uneven.weight.linear(x, None), reference) < RELATIVE_TOLERANCE


def test_greedy_with_a_small_draft_vocabulary_is_token_identical(models):
    target, draft, _ = models
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(target).generate(PROMPT, params)
    drafter = ModelDrafter(draft, target, draft_vocab=SMALL_VOCAB)
    result = Engine(target, drafter, SpecConfig("draft", 3)).generate(PROMPT, params)
    assert result.token_ids == plain.token_ids
    assert result.stats.drafter["draft_vocab"] == SMALL_VOCAB  # the statistics say which head the draft scored
    assert set(drafter.vocab.ids.tolist()) == {0, 1, 2, 3, 4}
    assert any(t in (5, 6) for t in plain.token_ids)  # the target does emit tokens the draft cannot propose


@pytest.mark.parametrize("name", ["T=1", "T=0.7,top-k=3"])
def test_sampling_with_a_small_draft_vocabulary_follows_the_target(models, name):
    target, draft, _ = models
    pvalue = engine_pvalue(target, draft, SETTINGS[name], drafter=ModelDrafter(draft, target, draft_vocab=SMALL_VOCAB))
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


class RecordingTreeDrafter(TreeDrafter):
    """A draft model's tree that keeps every token it drafted."""

    def propose(self, context_ids, k, params, generator):
        draft = super().propose(context_ids, k, params, generator)
        self.drafted = getattr(self, "drafted", set()) | set(draft.token_ids.tolist())
        return draft


def test_a_draft_tree_with_a_small_vocabulary_drafts_from_it_and_stays_exact(models):
    """Greedy: plain decoding's tokens, every drafted node among the rows (the target emits tokens outside them);
    sampling: the first two tokens follow the target (the tree rule needs no q, the rows only narrow the
    candidates). The builder hands draft_vocab and draft_confidence to the tree."""
    target, draft, _ = models
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(target).generate(PROMPT, params)
    spec = SpecConfig("draft", 3, tree=True, tree_budget=6, tree_depth=3, tree_branch=2)
    drafter = RecordingTreeDrafter(draft, target, 6, 3, 2, draft_vocab=SMALL_VOCAB)
    result = Engine(target, drafter, spec).generate(PROMPT, params)
    assert result.token_ids == plain.token_ids and result.stats.tree_passes > 0
    assert result.stats.drafter["draft_vocab"] == SMALL_VOCAB
    assert drafter.drafted <= set(drafter.vocab.ids.tolist()) and any(t in (5, 6) for t in plain.token_ids)
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], drafter=TreeDrafter(draft, target, 6, 3, 2,
                                                                               draft_vocab=SMALL_VOCAB), spec=spec)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"
    built = build_drafter(SpecConfig("draft", tree=True, draft_vocab=SMALL_VOCAB, draft_confidence=0.4), target,
                          draft)
    assert (built.inner.vocab_rows, built.inner.min_confidence) == (SMALL_VOCAB, 0.4)  # (behind lookup first)


def test_a_draft_step_is_priced_by_the_head_rows_it_scores_for_a_chain_and_a_tree(models):
    """draft_bytes: the draft model's weight bytes, less the head rows a reduced vocabulary skips; the chain and
    the tree of the same draft model and rows read the same bytes per draft step."""
    target, draft, _ = models
    full, small = ModelDrafter(draft, target, draft_vocab=0), ModelDrafter(draft, target, draft_vocab=SMALL_VOCAB)
    head = draft.native.lm_head
    assert full.draft_bytes == draft.weight_bytes > 0
    assert small.draft_bytes == draft.weight_bytes - (head.shape[0] - SMALL_VOCAB) * head[0].nbytes
    assert TreeDrafter(draft, target, 6, 3, 2, draft_vocab=0).draft_bytes == full.draft_bytes
    assert TreeDrafter(draft, target, 6, 3, 2, draft_vocab=SMALL_VOCAB).draft_bytes == small.draft_bytes


class MisplacedDrafter(ModelDrafter):
    """Deliberately wrong: puts each row's probability in the column of the next row's id (an off-by-one map from
    draft rows to target ids)."""

    def propose(self, context_ids, k, params, generator):
        draft = super().propose(context_ids, k, params, generator)
        if draft.draft_probs is not None:
            subset = draft.draft_probs[:, self.vocab.ids]  # [k, V_draft]
            wrong = torch.zeros_like(draft.draft_probs)
            wrong[:, self.vocab.ids] = subset.roll(1, dims=-1)
            draft.draft_probs = wrong
        return draft


def test_negative_control_q_in_the_wrong_columns_fails_the_same_test(models):
    target, draft, _ = models
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], drafter=MisplacedDrafter(draft, target, draft_vocab=SMALL_VOCAB))
    assert pvalue < P_THRESHOLD, f"the wrong drafter passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_a_draft_vocabulary_on_the_transformers_backend_is_a_clear_error(models):
    target, draft, _ = models
    on_transformers = load_model(draft.path, "float32", backend="transformers")
    with pytest.raises(SpecdraftError, match="native backend"):
        ModelDrafter(on_transformers, target, draft_vocab=4)
    with pytest.raises(SpecdraftError, match="draft vocabulary"):
        SpecConfig("draft", draft_vocab=-1)
    assert ModelDrafter(on_transformers, target).vocab_rows == 0  # auto, the default, scores all rows there


def test_auto_draft_vocabulary_is_32768_rows_on_a_larger_native_head_and_all_otherwise(models):
    from types import SimpleNamespace

    from specdraft.drafters.vocab import AUTO_ROWS, resolve_rows

    large, small = (SimpleNamespace(lm_head=torch.empty(rows, 2)) for rows in (151_936, AUTO_ROWS))
    assert resolve_rows(None, large) == AUTO_ROWS and resolve_rows(None, small) == 0  # the 0.5B; a small model
    assert resolve_rows(None, None) == 0  # transformers backend: no native head to take rows of
    assert resolve_rows(0, large) == 0 and resolve_rows(7, large) == 7  # explicit values stand
    target, draft, _ = models
    assert SpecConfig().setting("draft_vocab") is None and ModelDrafter(draft, target).vocab_rows == 0  # tiny vocabulary


def test_draft_vocab_flag_takes_auto_or_a_count_and_rejects_the_rest(capsys):
    from specdraft.bench.options import parse_method
    from specdraft.cli import main

    assert parse_method("draft[draft_vocab=auto]") == ("draft", {"options": {"draft_vocab": None}})
    assert parse_method("draft[draft_vocab=0]") == ("draft", {"options": {"draft_vocab": 0}})
    with pytest.raises(SpecdraftError, match="draft_vocab takes a row count or auto"):
        parse_method("draft[draft_vocab=-3]")
    with pytest.raises(SystemExit):
        main(["generate", "--draft-vocab", "many", "hi"])
    assert "--draft-vocab: expected a row count >= 0 or auto, got 'many'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ exit adapters

def adapters_for(deep, exits=(1, 2, 4), rank=3, trained=True, seed=0) -> ExitAdapters:
    native = deep.native
    config = AdapterConfig(draft="tiny", fingerprint=draft_fingerprint(native.final_norm, native.lm_head),
                           exits=exits, rank=rank, hidden_size=native.embed.shape[1], draft_vocab=SMALL_VOCAB,
                           eps=native.eps)
    adapters = ExitAdapters(config, native.final_norm, seed=seed)
    if trained:  # stands in for training: a far-from-identity adapter and per-exit norms
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            adapters.up.copy_(torch.randn(adapters.up.shape, generator=generator))
            adapters.norm.mul_(1 + 0.5 * torch.rand(adapters.norm.shape, generator=generator))
    return adapters.requires_grad_(False)


def test_fresh_adapters_are_the_bare_exits_bit_for_bit(models):
    target, _, deep = models
    bare = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,)))
    adapted = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,)), adapters_for(deep, trained=False))
    for drafter in (bare, adapted):
        drafter.begin(PROMPT)
        drafter.state.append(PROMPT[-1:])
    with torch.inference_mode():
        for index, depth in enumerate((1, 2, 4)):
            bare.state.run_to(depth)
            adapted.state.run_to(depth)
            assert torch.equal(bare.exit_logits(index), adapted.exit_logits(index))
            assert torch.equal(bare.exit_logits(index), deep.native.logits(bare.state.last_residual()))


def test_trained_adapters_change_the_exits_and_greedy_stays_token_identical(models):
    target, _, deep = models
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(target).generate(PROMPT, params).token_ids
    adapters = adapters_for(deep)
    drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.4, 0.6)), adapters, SMALL_VOCAB)
    result = Engine(target, drafter, SpecConfig("sorted", 4)).generate(PROMPT, params)
    assert result.token_ids == plain
    bare = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.4, 0.6)), draft_vocab=SMALL_VOCAB)
    for d in (bare, drafter):
        d.begin(PROMPT)
        d.state.append(PROMPT[-1:])
        d.state.run_to(2)
    assert not torch.allclose(bare.exit_logits(1), drafter.exit_logits(1))  # the adapter does something


def test_sampling_with_adapters_and_a_small_vocabulary_follows_the_target(models):
    target, draft, deep = models
    drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.4, 0.6)), adapters_for(deep), SMALL_VOCAB)
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], drafter=drafter, spec=SpecConfig("sorted", 3))
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def with_probes(adapters: ExitAdapters, bias: tuple[float, ...], seed: int = 5) -> ExitAdapters:
    """Probes that stand in for trained ones: random directions, and per-exit biases that set how often they stop."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        adapters.probe.copy_(torch.randn(adapters.probe.shape, generator=generator))
        adapters.probe_bias.copy_(torch.tensor(bias + (0.0,) * (adapters.probe_bias.shape[0] - len(bias))))
    adapters.config.probes = True
    return adapters


def test_probe_rule_stops_where_the_probe_says_and_runs_the_head_once_per_token(models, monkeypatch):
    target, _, deep = models
    params = SamplingParams(max_new_tokens=20)
    plain = Engine(target).generate(PROMPT, params).token_ids
    for bias, expected_exit in (((50.0,), 0), ((-50.0, -50.0), 2)):  # always stop at exit 1; never before the last
        drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,), signal="probe"),
                                with_probes(adapters_for(deep), bias), SMALL_VOCAB)
        heads = []
        original = drafter.head_logits
        monkeypatch.setattr(drafter, "head_logits", lambda hidden: heads.append(1) or original(hidden))
        result = Engine(target, drafter, SpecConfig("sorted", 3)).generate(PROMPT, params)
        assert result.token_ids == plain
        drafted = sum(drafter.exit_counts)
        assert drafter.exit_counts[expected_exit] == drafted > 0
        assert len(heads) == drafted  # one head per draft token, wherever it stops
    # control: the top-1 rule passing exits runs the head at each of them, so the count above can fail
    drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((1.0,)), adapters_for(deep), SMALL_VOCAB)
    heads = []
    original = drafter.head_logits
    monkeypatch.setattr(drafter, "head_logits", lambda hidden: heads.append(1) or original(hidden))
    Engine(target, drafter, SpecConfig("sorted", 3)).generate(PROMPT, params)
    assert len(heads) == 3 * sum(drafter.exit_counts)


def test_cost_probe_rule_weighs_the_probe_against_the_layers_left(models):
    """cost-probe:W stops at exit i when 1 - probe <= W x (the layers after exit i over the target's bytes): a sure
    probe stops at the first exit, an unsure one runs to the last; output stays plain decoding's."""
    from specdraft.drafters.sorted import cost_aware_rule

    target, _, deep = models
    params = SamplingParams(max_new_tokens=20)
    plain = Engine(target).generate(PROMPT, params).token_ids
    remaining = cost_aware_rule(deep.native, target, (1, 2, 4), 1.0, signal="probe").remaining_cost
    assert remaining[0] > remaining[1] > remaining[2] == 0
    # a weight that makes W x remaining < 1 at every exit: an unsure probe (1 - probe = 1) goes on
    rule = cost_aware_rule(deep.native, target, (1, 2, 4), 0.5 / remaining[0], signal="probe")
    assert rule.signal == "probe" and not rule.stop(0, 0.0) and rule.stop(0, 1.0)
    for bias, expected_exit in (((50.0,), 0), ((-50.0, -50.0), 2)):
        drafter = SortedDrafter(deep, target, (1, 2, 4), rule, with_probes(adapters_for(deep), bias), SMALL_VOCAB)
        result = Engine(target, drafter, SpecConfig("sorted", 3)).generate(PROMPT, params)
        assert result.token_ids == plain
        assert drafter.exit_counts[expected_exit] == sum(drafter.exit_counts) > 0
    with pytest.raises(SpecdraftError, match="exit probes"):  # the rule needs trained probes
        build_drafter(SpecConfig("sorted", 3, exit_rule="cost-probe:1", sorted_draft="none"), target, deep)


def test_a_sorted_draft_token_is_priced_by_the_exits_this_request_used(models):
    """gamma auto reads draft_bytes every pass: for the sorted draft the mean bytes of this request's draft tokens
    (the layers to each token's exit and the head rows it ran), the deepest exit standing in before the first."""
    from specdraft.drafters.sorted import EXIT_COST_PRIOR

    target, _, deep = models
    drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,), signal="probe"),
                            with_probes(adapters_for(deep), (50.0,)), SMALL_VOCAB)  # every token leaves at exit 1
    shallow, deepest = drafter.exit_bytes[0], drafter.exit_bytes[-1]
    assert shallow < drafter.exit_bytes[1] < deepest and drafter.draft_bytes == deepest
    result = Engine(target, drafter, SpecConfig("sorted", 3)).generate(PROMPT, SamplingParams(max_new_tokens=20))
    drafted = result.stats.drafted
    assert drafted > 0 and drafter.draft_bytes == pytest.approx(
        (drafted * shallow + EXIT_COST_PRIOR * deepest) / (drafted + EXIT_COST_PRIOR))
    drafter.begin([2, 3, 4])  # a new request starts from the prior again
    assert drafter.draft_bytes == deepest
    # the top-1 rules run the head at every exit they pass: a token at exit i pays i + 1 heads
    top1 = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,)), adapters_for(deep), SMALL_VOCAB)
    head_bytes = drafter.vocab.size * deep.native.lm_head[0].nbytes
    assert [t - p for t, p in zip(top1.exit_bytes, drafter.exit_bytes)] == [0, head_bytes, 2 * head_bytes]

    class CountedReads(SortedDrafter):
        reads = 0

        @property
        def draft_bytes(self):
            CountedReads.reads += 1
            return super().draft_bytes

    counted = CountedReads(deep, target, (1, 2, 4), ThresholdExit((0.5,), signal="probe"),
                           with_probes(adapters_for(deep), (50.0,)), SMALL_VOCAB)
    spec = SpecConfig("sorted", None, lookup_first=0)  # gamma auto reads the price before every pass
    result = Engine(target, counted, spec, curve=verify_curve(target, spec.draft_len + 1)).generate(
        PROMPT, SamplingParams(max_new_tokens=20))
    assert CountedReads.reads >= result.stats.target_passes > 1


def test_sampling_with_the_probe_rule_follows_the_target(models):
    target, draft, deep = models
    drafter = SortedDrafter(deep, target, (1, 2, 4), ThresholdExit((0.5,), signal="probe"),
                            with_probes(adapters_for(deep), (0.0, 0.0)), SMALL_VOCAB)
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], drafter=drafter, spec=SpecConfig("sorted", 3))
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_adapters_saved_before_probes_still_load_and_the_probe_rule_refuses_them(models, tmp_path):
    from safetensors.torch import load_file, save_file

    target, _, deep = models
    native = deep.native
    folder = save_adapters(adapters_for(deep), tmp_path / "old")
    tensors = {k: v for k, v in load_file(str(folder / "adapters.safetensors")).items() if not k.startswith("probe")}
    save_file(tensors, str(folder / "adapters.safetensors"))
    config = json.loads((folder / "adapters.json").read_text())
    config.pop("probes")
    (folder / "adapters.json").write_text(json.dumps(config))
    old = load_adapters(str(folder), native.final_norm, native.lm_head)
    assert not old.config.probes and float(old.probe.abs().sum()) == 0.0
    assert build_drafter(SpecConfig("sorted", sorted_draft=str(folder), lookup_first=0), target, deep).adapters is not None
    with pytest.raises(SpecdraftError, match="exit probes"):
        build_drafter(SpecConfig("sorted", sorted_draft=str(folder), exit_rule="probe:0.5"), target, deep)
    config["probes"] = True  # a file that claims probes but lacks them is refused
    (folder / "adapters.json").write_text(json.dumps(config))
    with pytest.raises(SpecdraftError, match="does not match"):
        load_adapters(str(folder), native.final_norm, native.lm_head)


def test_adapters_load_by_name_refuse_another_model_and_auto_finds_them(models, tmp_path, monkeypatch):
    target, draft, deep = models
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    adapters = adapters_for(deep)
    save_adapters(adapters, tmp_path / "sorted" / "tiny-sorted")
    native = deep.native
    loaded = load_adapters("tiny-sorted", native.final_norm, native.lm_head)
    for name, tensor in adapters.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert find_shipped(native.final_norm, native.lm_head) == str(tmp_path / "sorted" / "tiny-sorted")
    built = build_drafter(SpecConfig("sorted", lookup_first=0), target, deep)  # sorted_draft "auto"
    assert built.adapters is not None and built.exits == (1, 2, 4) and built.vocab is not None
    assert build_drafter(SpecConfig("sorted", sorted_draft="none", lookup_first=0), target, deep).adapters is None
    with pytest.raises(SpecdraftError, match="different model"):
        load_adapters("tiny-sorted", draft.native.final_norm, draft.native.lm_head)
    with pytest.raises(SpecdraftError, match="no sorted draft 'nope'.*tiny-sorted"):
        build_drafter(SpecConfig("sorted", sorted_draft="nope"), target, deep)
    with pytest.raises(SpecdraftError, match="trained exits at 1,2,4, not at 3"):
        build_drafter(SpecConfig("sorted", sorted_exits=(1, 3)), target, deep)


# ------------------------------------------------------------------------------------------------ training

@pytest.fixture(scope="module")
def chat_draft(tmp_path_factory):
    """The 4-layer tiny draft with a trivial chat template (the corpus is chat-formatted)."""
    root = tmp_path_factory.mktemp("sorted_train")
    path = build_model(root / "draft", seed=22, chars="abcdefghijklmnopqrstuvwxyz .", init_range=0.5, layers=4)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}.{% endfor %}"
    config_path.write_text(json.dumps(config))
    return path


def sorted_config(draft_path, out, steps, loss="both"):
    from specdraft.train.config import SortedTrainConfig

    return SortedTrainConfig(out=str(out), draft=str(draft_path), exits=(1, 2, 4), rank=4, draft_vocab=20,
                             loss=loss, steps=steps, window=32, windows_per_step=2, lr=2e-2, warmup_steps=2,
                             checkpoint_every=4, validation_windows=3, validate_against=(str(draft_path),))


@pytest.mark.parametrize("loss", ["text", "self"])
def test_training_lowers_the_loss_and_raises_agreement(chat_draft, tmp_path, loss):
    from specdraft.train.sorted_train import SortedTrainer

    trainer = SortedTrainer(sorted_config(chat_draft, tmp_path / "run", 24, loss), progress=False)
    trainer.run()
    first = sum(r["loss"] for r in trainer.history[:4]) / 4
    last = sum(r["loss"] for r in trainer.history[-4:]) / 4
    assert last < first
    # held out: "self" pulls the exits toward the draft's own greedy tokens, "text" toward the text
    before, after = trainer.history[0]["start"], trainer.history[-1]
    if loss == "self":
        assert after["val_agreement"][str(chat_draft)][0] > before["val_agreement"][str(chat_draft)][0]
    else:
        assert sum(after["val_text_agreement"]) > sum(before["val_text_agreement"])
    assert (tmp_path / "run" / "loss.png").is_file() and (tmp_path / "run" / "adapters.json").is_file()
    # the exit probes train: they start at log-odds 0 (loss log 2) and their loss falls. (On these random tiny
    # models whether an exit agrees with the last one is close to noise, so this checks that the probes get
    # gradients, not how well they predict: docs/s2d.md has their held-out figures on the real draft.)
    assert len(after["val_probe_stops"]) == 2 and trainer.adapters.config.probes
    assert trainer.history[0]["probe_loss"] == pytest.approx([math.log(2)] * 2)
    tail = [loss for r in trainer.history[-8:] for loss in r["probe_loss"]]
    assert sum(tail) / len(tail) < math.log(2) - 0.02


def test_resumed_training_reaches_the_same_adapters(chat_draft, tmp_path):
    from specdraft.train.sorted_train import SortedTrainer

    straight = SortedTrainer(sorted_config(chat_draft, tmp_path / "straight", 9), progress=False)
    straight.run()
    interrupted = SortedTrainer(sorted_config(chat_draft, tmp_path / "resumed", 9), progress=False)
    interrupted.run(stop_after=6)  # killed after step 6: the checkpoint holds step 4
    resumed = SortedTrainer(sorted_config(chat_draft, tmp_path / "resumed", 9), progress=False)
    assert resumed.step == 4
    resumed.run()
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for name, tensor in straight.adapters.state_dict().items():
        assert torch.equal(tensor, resumed.adapters.state_dict()[name]), name
    other = SortedTrainer(sorted_config(chat_draft, tmp_path / "other", 9), progress=False)
    other.run(stop_after=3)  # a run that really differs must not compare equal: the check can fail
    assert not torch.equal(other.adapters.up, straight.adapters.up)
    with pytest.raises(SpecdraftError, match="other settings"):
        SortedTrainer(replace(sorted_config(chat_draft, tmp_path / "straight", 9), rank=5), progress=False)


def test_training_on_a_chats_corpus_too_small_for_the_steps_fails_before_training(chat_draft, tmp_path):
    from specdraft.train.sorted_train import SortedTrainer

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "model": "m", "messages": [
        ["user", "say something"], ["assistant", "abc def ghi " * 4]]}) + "\n" for i in range(50)))
    config = replace(sorted_config(chat_draft, tmp_path / "run", 4), corpus=f"chats:{chats}")
    trainer = SortedTrainer(config, progress=False)  # 10 training documents, two windows each: 4 steps fit
    assert trainer.stream.val_docs[0].source.startswith("chats:m:")
    with pytest.raises(SpecdraftError, match="holds 20 training windows"):
        SortedTrainer(replace(config, out=str(tmp_path / "big"), steps=11), progress=False)


def test_probes_can_predict_agreement_with_a_served_model(chat_draft, tmp_path):
    from specdraft.train.sorted_train import SortedTrainer

    other = build_model(tmp_path / "other", seed=23, chars="abcdefghijklmnopqrstuvwxyz .", init_range=0.5, layers=2)
    own = SortedTrainer(sorted_config(chat_draft, tmp_path / "self", 3), progress=False)
    own.run()
    served = SortedTrainer(replace(sorted_config(chat_draft, tmp_path / "served", 3), probe_target=str(other)),
                           progress=False)
    served.run()
    reference = torch.load(tmp_path / "served" / "probe_reference.pt", weights_only=False)
    assert sorted(reference) == list(range(6))  # 3 steps x 2 windows, each run through the served model once
    alone = load_model(str(other), "float32").new_state()
    assert torch.equal(reference[0], alone.forward(served.stream.get(0), len(served.stream.get(0))).argmax(-1))
    # the labels changed with the target: a random other model rarely agrees with an exit, the draft's own last
    # exit often does
    assert [r["probe_base_rate"] for r in served.history] != [r["probe_base_rate"] for r in own.history]
    with pytest.raises(SpecdraftError, match="other settings"):  # resuming with another probe target is refused
        SortedTrainer(replace(sorted_config(chat_draft, tmp_path / "served", 3)), progress=False)


def test_fine_tuning_starts_from_the_given_adapters(chat_draft, tmp_path):
    from specdraft.train.sorted_train import SortedTrainer

    first = SortedTrainer(sorted_config(chat_draft, tmp_path / "first", 4), progress=False)
    first.run()
    tuned = SortedTrainer(replace(sorted_config(chat_draft, tmp_path / "tuned", 4), init=str(tmp_path / "first")),
                          progress=False)
    for name, tensor in first.adapters.state_dict().items():
        assert torch.equal(tensor, tuned.adapters.state_dict()[name]), name
    fresh = SortedTrainer(sorted_config(chat_draft, tmp_path / "fresh", 4), progress=False)
    assert not torch.equal(fresh.adapters.up, first.adapters.up)  # the comparison above can fail
    with pytest.raises(SpecdraftError, match="rank 4, this run 5"):
        SortedTrainer(replace(sorted_config(chat_draft, tmp_path / "r5", 4), rank=5, init=str(tmp_path / "first")),
                      progress=False)


def test_train_sorted_command_then_generate_with_the_result(chat_draft, tmp_path, capsys):
    from specdraft.cli import main

    out = tmp_path / "cli-run"
    assert main(["train", "sorted", "--out", str(out), "--draft", str(chat_draft), "--exits", "1,2,4", "--rank",
                 "2", "--draft-vocab", "16", "--steps", "3", "--window", "16", "--checkpoint-every", "3",
                 "--validate-against", str(chat_draft), "--threads", "1"]) == 0
    assert "--sorted-draft" in capsys.readouterr().out
    assert main(["generate", "abc", "--target", str(chat_draft), "--draft", str(chat_draft), "--method", "sorted",
                 "--sorted-draft", str(out), "--max-new-tokens", "8", "--temperature", "0", "--threads", "1",
                 "--backend", "native", "--dtype", "float32"]) == 0
    assert main(["train", "sorted", "--out", str(out), "--loss", "kl"]) == 2


def test_sorted_training_with_exits_past_the_draft_leaves_no_out_folder(chat_draft, tmp_path):
    from dataclasses import replace

    from specdraft.train.sorted_train import SortedTrainer

    config = replace(sorted_config(chat_draft, tmp_path / "run", 4), exits=(1, 2, 9))  # the draft has 4 layers
    with pytest.raises(SpecdraftError, match="exits go up to 9 layers"):
        SortedTrainer(config, progress=False)
    assert not (tmp_path / "run").exists()
