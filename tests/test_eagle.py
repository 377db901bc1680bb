"""EAGLE-3-style head: feature taps, lossless drafting (greedy and sampled), training resume, export round trip."""

from __future__ import annotations

import pytest
import torch

from specdraft import SpecdraftError, load_model

TOKENS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


# ------------------------------------------------------------------------------------------------ feature taps

@pytest.mark.parametrize("layers", [(0, 1, 2), (1,), (2, 0)])
def test_feature_taps_equal_transformers_output_hidden_states(tiny_models, layers):
    model = tiny_models["target"]
    with torch.inference_mode():
        reference = model.model(input_ids=torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
        state = model.new_state(feature_layers=layers)
        state.forward(TOKENS[:6], 1)
        first = state.features  # [6, n_taps, D]
        state.forward(TOKENS[6:], 2)
        second = state.features  # [4, n_taps, D]
    expected = torch.stack([reference[i][0] for i in layers], dim=1)  # [10, n_taps, D]
    got = torch.cat([first, second])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_feature_taps_equal_on_both_backends(tiny_dirs):
    layers = (0, 1, 2)
    native = load_model(str(tiny_dirs["target"]), "float32", backend="native")
    hf = load_model(str(tiny_dirs["target"]), "float32", backend="transformers")
    with torch.inference_mode():
        taps = []
        for model in (native, hf):
            state = model.new_state(feature_layers=layers)
            state.forward(TOKENS[:7], 1)
            state.truncate(5)
            state.forward(TOKENS[5:], 3)
            taps.append(state.features)
    assert taps[0].shape == (5, 3, native.hidden_size)
    torch.testing.assert_close(taps[0], taps[1], rtol=1e-4, atol=1e-4)


def test_no_taps_requested_means_no_features(tiny_models):
    state = tiny_models["target"].new_state()
    with torch.inference_mode():
        state.forward(TOKENS[:3], 1)
    assert state.features is None


def test_feature_layer_out_of_range_is_a_user_error(tiny_models):
    with pytest.raises(SpecdraftError, match="outside"):
        tiny_models["target"].new_state(feature_layers=(0, 3))


# ------------------------------------------------------------------------------------------------ the head

from specdraft import Engine, SamplingParams, SpecConfig
from specdraft.drafters import EagleDrafter
from specdraft.drafters.eagle_head import head_config_for, new_head
from specdraft.train.eagle_data import vocab_hash

PROMPTS = ["abc ab", "j. ihg", "a", "dead beef cafe. dead be"]
GREEDY = SamplingParams(max_new_tokens=24)


def tiny_head(target, draft_vocab: int = 8, seed: int = 0, layers=(0, 1, 2), scale: float = 1.0):
    """An untrained head over a reduced vocabulary (a lossless engine must not care how bad it is)."""
    config = head_config_for(target.name, target.model.config, target.vocab_size, layers, draft_vocab,
                             vocab_hash(target.tokenizer), intermediate_size=48)
    draft_to_target = torch.arange(target.vocab_size - draft_vocab, target.vocab_size)  # drops <unk>, <eos>, ...
    model = target.model
    head = new_head(config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                    model.model.norm.weight, draft_to_target, seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(scale)
    return head


def eagle_engine(target, head, gamma: int = 4) -> Engine:
    return Engine(target, EagleDrafter(head, target), SpecConfig("eagle", gamma, eagle_head="(in memory)"))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_eagle_equals_autoregressive(tiny_models, gamma):
    target = tiny_models["target"]
    head = tiny_head(target)
    for prompt in PROMPTS:
        ids = Engine(target).encode(prompt, chat=False)
        expected = Engine(target).generate(ids, GREEDY)
        got = eagle_engine(target, head, gamma).generate(ids, GREEDY)
        assert got.token_ids == expected.token_ids, prompt
        assert got.stats.drafted > 0 or len(ids) == 1


# ------------------------------------------------------------------------------------------------ training

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}.{% endfor %}"
                 "{% if add_generation_prompt %} {% endif %}")


@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    """The real collection pipeline on the tiny target (its character tokenizer given a trivial chat template)."""
    from tiny import build_model

    from specdraft.train.eagle_data import CollectConfig, collect

    root = tmp_path_factory.mktemp("eagle_data")
    target_dir = with_chat_template(build_model(root / "target", seed=5, layers=3))
    folder = collect(CollectConfig(target=str(target_dir), out=str(root / "features"), tokens=400, max_len=48,
                                   layers=(1, 2, 3), dtype="float32", backend="native", threads=1),
                     progress=False)
    return target_dir, folder


def with_chat_template(target_dir):
    import json

    config_path = target_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    return target_dir


def test_collected_features_match_a_fresh_forward(tiny_features):
    from specdraft.train.eagle_data import FeatureStore

    target_dir, folder = tiny_features
    store = FeatureStore(folder)
    assert store.n_tokens >= 400 and store.meta["layers"] == [1, 2, 3]
    tokens, taps, final = store.sequence(0)
    model = load_model(str(target_dir), "float32", backend="transformers")
    with torch.inference_mode():
        hidden = model.model(input_ids=tokens[None], output_hidden_states=True).hidden_states
    expected = torch.stack([hidden[i][0] for i in (1, 2, 3)], dim=1)
    torch.testing.assert_close(taps, expected, rtol=1e-2, atol=1e-2)  # stored in bf16
    torch.testing.assert_close(final, hidden[3][0], rtol=1e-2, atol=1e-2)


def train_config(folder, out, steps, compute_dtype="float32"):
    from specdraft.train.config import TrainConfig

    return TrainConfig(data=str(folder), out=str(out), steps=steps, ttt_steps=3, window=24, draft_vocab=10,
                       intermediate_size=32, lr=3e-3, warmup_steps=2, checkpoint_every=3,
                       compute_dtype=compute_dtype)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_training_lowers_the_loss(tiny_features, tmp_path, compute_dtype):
    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    trainer = Trainer(train_config(folder, tmp_path / "head", 30, compute_dtype), progress=False)
    trainer.run()
    first = sum(r["loss"] for r in trainer.history[:5]) / 5
    last = sum(r["loss"] for r in trainer.history[-5:]) / 5
    assert last < first
    assert (tmp_path / "head" / "loss.png").is_file() and (tmp_path / "head" / "train_log.jsonl").is_file()
    assert "val_agreement" in trainer.history[-1]


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_resumed_training_reaches_the_same_state(tiny_features, tmp_path, compute_dtype):
    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    straight = Trainer(train_config(folder, tmp_path / "straight", 9, compute_dtype), progress=False)
    straight.run()
    interrupted = Trainer(train_config(folder, tmp_path / "resumed", 9, compute_dtype), progress=False)
    interrupted.run(stop_after=4)  # killed after step 4: the checkpoint holds step 3, step 4 is redone
    assert interrupted.step == 4
    resumed = Trainer(train_config(folder, tmp_path / "resumed", 9, compute_dtype), progress=False)
    assert resumed.step == 3
    resumed.run()
    assert resumed.step == straight.step == 9
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for name, tensor in straight.head.state_dict().items():
        assert torch.equal(tensor, resumed.head.state_dict()[name]), name
    other = Trainer(train_config(folder, tmp_path / "other", 9), progress=False)
    other.run(stop_after=3)  # a run that really differs (fewer steps) must not compare equal: the check can fail
    assert not torch.equal(other.head.fc.weight, straight.head.fc.weight)


def test_bf16_training_computes_in_bf16_and_stays_near_float32(tiny_features, tmp_path):
    """--compute-dtype bfloat16 runs the step's products in bf16 (its losses differ from fp32's: autocast is on)
    while the losses stay within bf16 rounding of fp32's and the parameters stay float32."""
    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    runs = {dtype: Trainer(train_config(folder, tmp_path / dtype, 3, dtype), progress=False)
            for dtype in ("float32", "bfloat16")}
    records = {dtype: trainer.train_step(0) for dtype, trainer in runs.items()}
    fp32, bf16 = records["float32"]["step_losses"], records["bfloat16"]["step_losses"]
    assert fp32 != bf16
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=2e-2)
    assert all(p.dtype == torch.float32 for p in runs["bfloat16"].head.parameters())


def test_compute_dtype_auto_resolves_and_a_wrong_one_is_a_user_error(tmp_path):
    from specdraft.config import cpu_has_native_bf16
    from specdraft.train.config import TrainConfig

    auto = TrainConfig(data="x", out=str(tmp_path))
    assert auto.compute_dtype == ("bfloat16" if cpu_has_native_bf16() else "float32")
    for wrong in ("float16", "int8"):
        with pytest.raises(SpecdraftError, match="compute-dtype"):
            TrainConfig(data="x", out=str(tmp_path), compute_dtype=wrong)


def test_resuming_with_other_settings_is_a_user_error(tiny_features, tmp_path):
    from dataclasses import replace

    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    Trainer(train_config(folder, tmp_path / "run", 3), progress=False).run()
    with pytest.raises(SpecdraftError, match="other settings"):
        Trainer(replace(train_config(folder, tmp_path / "run", 3), lr=1e-2), progress=False)


def test_init_goes_on_from_a_trained_head_and_refuses_one_that_does_not_fit(tiny_features, tmp_path):
    """--init NAME: the run starts from the trained head's parameters and vocabulary (its first loss is the
    trained head's, well below a fresh head's), trains on, and resumes like any run; a head for other features
    or of another shape is a user error."""
    import json
    import shutil
    from dataclasses import replace

    from specdraft.drafters.eagle_head import read_head
    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    trained = Trainer(train_config(folder, tmp_path / "trained", 30), progress=False)
    trained.run()
    config = replace(train_config(folder, tmp_path / "tuned", 6), init=str(tmp_path / "trained"))
    tuned = Trainer(config, progress=False)
    _, saved = read_head(str(tmp_path / "trained"))
    for name, tensor in tuned.head.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    fresh = Trainer(train_config(folder, tmp_path / "fresh", 6), progress=False)
    first = {run: trainer.train_step(0)["loss"] for run, trainer in (("tuned", tuned), ("fresh", fresh))}
    assert first["tuned"] < 0.8 * first["fresh"]
    tuned = Trainer(config, progress=False)
    tuned.run()
    assert tuned.head.config.extra["init"] == str(tmp_path / "trained") and "init_extra" in tuned.head.config.extra
    assert not torch.equal(tuned.head.fc.weight, trained.head.fc.weight)  # it trained on
    with pytest.raises(SpecdraftError, match="draft-vocab 10"):
        Trainer(replace(config, out=str(tmp_path / "wider"), draft_vocab=12), progress=False)
    other = tmp_path / "other-target"
    shutil.copytree(tmp_path / "trained", other, ignore=shutil.ignore_patterns("*.pt"))
    head_json = json.loads((other / "head.json").read_text())
    (other / "head.json").write_text(json.dumps({**head_json, "vocab_hash": "another tokenizer"}))
    with pytest.raises(SpecdraftError, match="a different tokenizer vocabulary"):
        Trainer(replace(config, out=str(tmp_path / "x"), init=str(other)), progress=False)
    with pytest.raises(SpecdraftError, match="no EAGLE head"):
        Trainer(replace(config, out=str(tmp_path / "y"), init=str(tmp_path / "absent")), progress=False)


def test_a_checkpoint_from_before_compute_dtype_resumes_as_float32(tiny_features, tmp_path):
    """Checkpoints written before --compute-dtype existed trained in float32: they resume as such, and a bf16
    run does not take them over."""
    from specdraft.train.common import CHECKPOINT
    from specdraft.train.eagle_train import Trainer

    _, folder = tiny_features
    Trainer(train_config(folder, tmp_path / "run", 6), progress=False).run(stop_after=3)
    path = tmp_path / "run" / CHECKPOINT
    ckpt = torch.load(path, weights_only=False)
    del ckpt["train_config"]["compute_dtype"], ckpt["train_config"]["init"]  # neither existed then
    torch.save(ckpt, path)
    assert Trainer(train_config(folder, tmp_path / "run", 6, "float32"), progress=False).step == 3
    with pytest.raises(SpecdraftError, match="other settings"):
        Trainer(train_config(folder, tmp_path / "run", 6, "bfloat16"), progress=False)


def test_training_on_two_folders_reads_both_and_holds_out_from_each(tiny_features, tmp_path):
    """--data A+B: corpora collected apart train one head; each folder gives held-out sequences."""
    from specdraft.train.eagle_data import CollectConfig, collect
    from specdraft.train.eagle_train import Trainer

    target_dir, folder = tiny_features
    second = collect(CollectConfig(target=str(target_dir), out=str(tmp_path / "second"), tokens=150, max_len=30,
                                   layers=(1, 2, 3), dtype="float32", backend="native", threads=1),
                     progress=False)
    both = Trainer(train_config(f"{folder}+{second}", tmp_path / "both", 3), progress=False)
    one = Trainer(train_config(folder, tmp_path / "one", 3), progress=False)
    n_first = len(one.store.sequences)
    assert len(both.store.sequences) == n_first + len(both.store.stores[1].sequences)
    assert {w[0] for w in both.val_ids} & set(range(n_first)) == {w[0] for w in one.val_ids}
    assert any(w[0] >= n_first for w in both.val_ids) and any(w[0] >= n_first for w in both.train_ids)
    index = next(w[0] for w in both.train_ids if w[0] >= n_first)
    for got, expected in zip(both.store.sequence(index), both.store.stores[1].sequence(index - n_first)):
        assert torch.equal(got, expected)
    both.run()
    assert both.head.config.extra["data"] == f"{folder}+{second}"
    other_target = build_other_target(tmp_path)
    third = collect(CollectConfig(target=str(other_target), out=str(tmp_path / "third"), tokens=60, max_len=30,
                                  layers=(1, 2, 3), dtype="float32", backend="native", threads=1), progress=False)
    with pytest.raises(SpecdraftError, match="another"):
        Trainer(train_config(f"{folder}+{third}", tmp_path / "mixed", 3), progress=False)


def build_other_target(tmp_path):
    """A tiny target of another width (a folder of another target must be refused)."""
    from tiny import build_model

    return with_chat_template(build_model(tmp_path / "other_target", seed=6, layers=3, hidden=64))


def test_head_cache_rollback_matches_a_fresh_head_pass(tiny_models):
    """After many passes with rejections, the head's committed rows equal one pass over the same taps."""
    target = tiny_models["target"]
    head = tiny_head(target)
    drafter = EagleDrafter(head, target)
    engine = Engine(target, drafter, SpecConfig("eagle", 4, eagle_head="(in memory)"))
    ids = engine.encode("dead beef cafe. dead be", chat=False)
    result = engine.generate(ids, SamplingParams(max_new_tokens=20))
    assert result.stats.target_passes > 1
    sequence = ids + result.token_ids
    drafter.cache.truncate(drafter.committed)
    with torch.inference_mode():
        state = target.new_state(feature_layers=drafter.feature_layers)
        state.forward(sequence[: drafter.committed], 1)
        from specdraft.drafters.eagle_head import HeadCache

        fresh = HeadCache(head.config)
        head.step(head.fuse(state.features), torch.tensor(sequence[1: drafter.committed + 1]), fresh)
    n = drafter.committed
    torch.testing.assert_close(drafter.cache.keys[:, :n], fresh.keys[:, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drafter.cache.values[:, :n], fresh.values[:, :n], rtol=1e-4, atol=1e-4)


def test_draft_probs_are_zero_outside_the_reduced_vocabulary(tiny_models):
    target = tiny_models["target"]
    head = tiny_head(target, draft_vocab=5)
    drafter = EagleDrafter(head, target)
    ids = [2, 3, 4, 5]
    with torch.inference_mode():
        state = target.new_state(feature_layers=drafter.feature_layers)
        state.forward(ids[:-1], 1)
    drafter.begin(ids, state.features)
    draft = drafter.propose(ids, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.draft_probs.shape == (3, target.vocab_size)
    outside = ~head.t2d
    assert float(draft.draft_probs[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(draft.draft_probs.sum(-1), torch.ones(3))
    assert bool(head.t2d[draft.token_ids].all())


# ------------------------------------------------------------------------------------------------ sampling

@pytest.fixture(scope="module", params=["native", "transformers"])
def small_vocab_target(tmp_path_factory, request):
    from tiny import build_model

    root = tmp_path_factory.mktemp("eagle_small_vocab")
    return load_model(str(build_model(root / "t", seed=11, chars="abcde", init_range=0.5)), "float32",
                      backend=request.param)


def eagle_pvalue(target, head, params, rule=None) -> float:
    """The chi-square test of tests/test_exactness.py (same N and threshold) with the EAGLE drafter."""
    from test_exactness import N_SAMPLES, engine_chi_square_pvalue

    engine = Engine(target, EagleDrafter(head, target), SpecConfig("eagle", 3, eagle_head="(in memory)"),
                    **({"sampling_rule": rule} if rule else {}))
    return engine_chi_square_pvalue(engine, target, params, N_SAMPLES)


def peaky_head(target):
    """A head over 4 of the 7 ids (<unk> and two letters left out), sharp enough to differ from the target."""
    return tiny_head(target, draft_vocab=4, seed=3, layers=(0, 1, 2), scale=4.0)


@pytest.mark.parametrize("setting", ["T=1", "T=0.7,top-k=3"])
def test_sampled_eagle_output_follows_the_target_distribution(small_vocab_target, setting):
    from test_exactness import N_SAMPLES, P_THRESHOLD, SETTINGS

    pvalue = eagle_pvalue(small_vocab_target, peaky_head(small_vocab_target), SETTINGS[setting])
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_negative_control_always_accepting_eagle_drafts_fails(small_vocab_target):
    from test_acceptance import always_accept
    from test_exactness import N_SAMPLES, P_THRESHOLD, SETTINGS

    pvalue = eagle_pvalue(small_vocab_target, peaky_head(small_vocab_target), SETTINGS["T=1"], always_accept)
    assert pvalue < P_THRESHOLD, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


# ------------------------------------------------------------------------------------------------ export, errors

EAGLE3_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                  "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                  "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
                  "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                  "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                  "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}


def test_eagle3_export_round_trip(tiny_models, tmp_path):
    import json

    from safetensors.torch import load_file

    from specdraft.drafters.eagle_head import export_eagle3, load_head

    target = tiny_models["target"]
    head = tiny_head(target, draft_vocab=6)
    folder = export_eagle3(head, tmp_path / "eagle3", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 6 and config["vocab_size"] == target.vocab_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    tensors = load_file(str(folder / "model.safetensors"))
    assert set(tensors) == EAGLE3_TENSORS
    assert tensors["fc.weight"].shape == (target.hidden_size, 3 * target.hidden_size)
    assert torch.equal(tensors["d2t"] + torch.arange(6), head.d2t)  # offsets, as vLLM and SGLang add them
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 6
    loaded = load_head(str(folder), target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    ids = Engine(target).encode("abc ab", chat=False)
    first = eagle_engine(target, head).generate(ids, GREEDY)
    again = eagle_engine(target, loaded).generate(ids, GREEDY)
    assert first.token_ids == again.token_ids and first.stats.accepted == again.stats.accepted


def test_saved_head_loads_by_name_from_the_heads_folder(tiny_models, tmp_path, monkeypatch):
    from specdraft.drafters import build_drafter
    from specdraft.drafters.eagle_head import load_head, save_head

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    target = tiny_models["target"]
    head = tiny_head(target)
    save_head(head, tmp_path / "heads" / "tiny-head")
    assert torch.equal(load_head("tiny-head", target).fc.weight, head.fc.weight)
    drafter = build_drafter(SpecConfig("eagle", 3, eagle_head="tiny-head"), target, None)
    assert drafter.feature_layers == (0, 1, 2)


def test_missing_head_is_a_user_error(tiny_models, tmp_path, monkeypatch):
    from specdraft.drafters import build_drafter
    from specdraft.drafters.eagle_head import load_head

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    with pytest.raises(SpecdraftError, match="needs a trained head"):
        build_drafter(SpecConfig("eagle", 3), tiny_models["target"], None)
    with pytest.raises(SpecdraftError, match="no EAGLE head 'nowhere'"):
        load_head("nowhere", tiny_models["target"])


@pytest.mark.parametrize("other", [{"hidden": 48}, {"chars": "klmnopqrstuv"}], ids=["hidden", "vocabulary"])
def test_head_for_another_target_is_refused(tiny_models, tmp_path, other):
    from tiny import build_model

    from specdraft.drafters.eagle_head import load_head, save_head

    save_head(tiny_head(tiny_models["target"]), tmp_path / "head")
    wrong = load_model(str(build_model(tmp_path / "wrong", seed=9, **other)), "float32")
    with pytest.raises(SpecdraftError, match="was trained for"):
        load_head(str(tmp_path / "head"), wrong)


# ------------------------------------------------------------------------------------------------ trees

from specdraft.drafters import EagleTreeDrafter


def eagle_tree_engine(target, head, budget=6, depth=3, branch=2, **rules) -> Engine:
    spec = SpecConfig("eagle-tree", 3, eagle_head="(in memory)", tree_budget=budget, tree_depth=depth,
                      tree_branch=branch)
    return Engine(target, EagleTreeDrafter(head, target, budget, depth, branch), spec, **rules)


@pytest.mark.parametrize("budget,depth,branch", [(1, 1, 1), (6, 3, 2), (10, 4, 3)])
def test_greedy_eagle_tree_equals_autoregressive(tiny_models, budget, depth, branch):
    target = tiny_models["target"]
    head = tiny_head(target)
    for prompt in PROMPTS:
        ids = Engine(target).encode(prompt, chat=False)
        expected = Engine(target).generate(ids, GREEDY)
        got = eagle_tree_engine(target, head, budget, depth, branch).generate(ids, GREEDY)
        assert got.token_ids == expected.token_ids, prompt


def test_eagle_tree_rows_equal_the_chain_rows_along_each_branch(tiny_models):
    """A tree node's head output equals the output of a chain that drafted exactly its branch."""
    target = tiny_models["target"]
    head = tiny_head(target)
    ids = [2, 3, 4, 5, 6]
    with torch.inference_mode():
        state = target.new_state(feature_layers=(0, 1, 2))
        state.forward(ids[:-1], 1)
    tree = EagleTreeDrafter(head, target, budget=8, depth=3, branch=2)
    tree.begin(ids, state.features)
    draft = tree.propose(ids, 3, GREEDY, None)
    parents = draft.parent_list
    assert draft.k > 3 and len(set(parents)) < draft.k  # a real tree, not a chain
    from specdraft.drafters.eagle_head import HeadCache

    with torch.inference_mode():
        for node in range(draft.k):
            branch = []
            while node >= 0:
                branch.insert(0, int(draft.token_ids[node]))
                node = parents[node]
            cache = HeadCache(head.config)
            hidden = head.step(head.fuse(state.features), torch.tensor(ids[1:]), cache)[-1:]
            for token in branch[:-1]:
                hidden = head.step(hidden, torch.tensor([token]), cache)
            # the branch's last token was chosen among the top children of its parent's row
            scores = head.full_vocab_logits(head.draft_logits(hidden))[0]
            assert int(branch[-1]) in torch.topk(scores, 2).indices.tolist()


@pytest.mark.parametrize("setting", ["T=1"])
def test_sampled_eagle_tree_output_follows_the_target_distribution(small_vocab_target, setting):
    import numpy as np
    from scipy.stats import chisquare
    from test_exactness import (
        N_SAMPLES,
        P_THRESHOLD,
        PROMPT,
        SETTINGS,
        exact_joint,
        outcome,
    )

    target, params = small_vocab_target, SETTINGS[setting]
    engine = eagle_tree_engine(target, peaky_head(target), budget=5, depth=3, branch=2)
    expected = exact_joint(target, params)
    counts = dict.fromkeys(expected, 0)
    for seed in range(N_SAMPLES):
        key = outcome(engine.generate(PROMPT, SamplingParams(**{**params.__dict__, "seed": seed})),
                      target.eos_token_ids)
        counts[key] = counts.get(key, 0) + 1
    observed = np.array([counts[k] for k in counts], dtype=float)
    expected_counts = np.array([expected.get(k, 0.0) * N_SAMPLES for k in counts])
    assert not (expected_counts[observed > 0] == 0).any()
    small = expected_counts < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected_counts = np.append(expected_counts[~small], expected_counts[small].sum())
    keep = expected_counts > 0
    observed, expected_counts = observed[keep], expected_counts[keep]
    expected_counts *= observed.sum() / expected_counts.sum()
    pvalue = float(chisquare(observed, expected_counts).pvalue)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_training_unroll_equals_inference_chain(tiny_models):
    """Training-time test computes, for every anchor at once, the rows the drafter's cache holds when it drafts
    token j: the logits must equal a chain run with the head's own step (same tokens fed)."""
    from specdraft.drafters.eagle_head import HeadCache
    from specdraft.train.eagle_train import ttt_logits

    target = tiny_models["target"]
    head = tiny_head(target, draft_vocab=10)
    tokens = torch.tensor([2, 5, 7, 3, 9, 4, 4, 8, 6, 2, 11, 3])
    with torch.inference_mode():
        state = target.new_state(feature_layers=(0, 1, 2))
        state.forward(tokens.tolist(), 1)
        taps = state.features  # [12, 3, D]
        unrolled = ttt_logits(head, tokens, taps, ttt_steps=3, start=0)
        for anchor in (0, 4, 8):
            cache = HeadCache(head.config)
            hidden = head.step(head.fuse(taps[: anchor + 1]), tokens[1: anchor + 2], cache)[-1:]
            for j in range(1, 4):
                torch.testing.assert_close(head.draft_logits(hidden)[0], unrolled[j - 1][anchor], rtol=1e-4,
                                           atol=1e-4)
                if j < 3:
                    hidden = head.step(hidden, tokens[anchor + j + 1: anchor + j + 2], cache)


def test_train_command_collects_trains_and_exports(tiny_features, tmp_path):
    from specdraft.cli import main

    target_dir, _ = tiny_features
    out, export = tmp_path / "head", tmp_path / "eagle3"
    argv = ["train", "eagle", "--target", str(target_dir), "--out", str(out), "--data", str(tmp_path / "data"),
            "--tokens", "150", "--max-len", "40", "--steps", "3", "--window", "20", "--draft-vocab", "10",
            "--intermediate-size", "32", "--threads", "1", "--export", str(export)]
    assert main(argv) == 0
    assert (out / "head.json").is_file() and (out / "loss.png").is_file()
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert main(argv) == 0  # everything done already: resumes both phases without redoing them


def test_train_command_refuses_bad_settings_before_collecting(tiny_features, tmp_path, capsys):
    """A wrong training setting is reported at once, not after a collection that can take an hour."""
    from specdraft.cli import main

    target_dir, _ = tiny_features
    argv = ["train", "eagle", "--target", str(target_dir), "--out", str(tmp_path / "head"), "--data",
            str(tmp_path / "data"), "--tokens", "150", "--compute-dtype", "fp16"]
    assert main(argv) != 0
    assert "--compute-dtype" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
    assert main(argv[:-2] + ["--init", "no-such-head"]) != 0  # a wrong name fails before the collection too
    assert "no EAGLE head 'no-such-head'" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_native_bf16_head_drafts_close_to_its_fp32_self_and_stays_lossless(tiny_models):
    """use_native_bf16: bf16 copies of every matrix through the native kernels. The layer output and the draft
    logits stay within bf16 rounding of the fp32 head's, the parameters are untouched, and the engine's greedy
    output still equals plain decoding (chain and tree)."""
    from specdraft.drafters.eagle import EagleTreeDrafter
    from specdraft.drafters.eagle_head import HeadCache
    from specdraft.models.native.kernels import load_kernels, unavailable_reason

    if unavailable_reason() is not None:
        pytest.fail(f"the native kernels must build on the test machine: {unavailable_reason()}")
    target = tiny_models["target"]
    reference, head = tiny_head(target, scale=2.0), tiny_head(target, scale=2.0)
    before = {name: p.detach().clone() for name, p in head.named_parameters()}
    head.use_native_bf16(load_kernels())
    head.eval(), reference.eval()  # as EagleDrafter holds them
    generator = torch.Generator().manual_seed(3)
    taps = torch.randn(5, 3, head.config.target_hidden_size, generator=generator)  # [T, 3, D_t]
    next_ids = torch.randint(3, target.vocab_size, (5,), generator=generator)
    with torch.inference_mode():
        outs = [h.step(h.fuse(taps), next_ids, HeadCache(h.config)) for h in (reference, head)]  # [T, D] each
        logits = [h.draft_logits(out) for h, out in zip((reference, head), outs)]
    scale = logits[0].abs().max()
    assert (logits[1] - logits[0]).abs().max() < 0.05 * scale  # bf16 rounding of weights and activations
    assert not torch.equal(logits[1], logits[0])  # the bf16 path did run
    assert all(torch.equal(p, before[name]) for name, p in head.named_parameters())
    # gamma auto prices a draft token by the bytes a step reads: the bf16 copies are half the fp32 matrices
    matrices = sum(m.weight.numel() for m in head.modules() if isinstance(m, torch.nn.Linear))
    assert reference.step_bytes() - head.step_bytes() == 2 * matrices
    assert EagleDrafter(head, target).draft_bytes == head.step_bytes()
    with torch.inference_mode():  # in training mode the head reads its parameters, not the copies
        assert torch.equal(head.train().draft_logits(outs[0]), reference.draft_logits(outs[0]))
    head.eval()
    for drafter in (EagleDrafter(head, target), EagleTreeDrafter(head, target, budget=6, depth=3, branch=2)):
        engine = Engine(target, drafter, SpecConfig("eagle", 4, eagle_head="(in memory)"))
        for prompt in PROMPTS:
            ids = Engine(target).encode(prompt, chat=False)
            assert engine.generate(ids, GREEDY).token_ids == Engine(target).generate(ids, GREEDY).token_ids
