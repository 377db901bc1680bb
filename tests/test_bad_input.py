"""A user's mistakes end in a clear SpecdraftError, before anything is lost or loaded (an audit of the
CLI, the server and the trainers: each case here was a traceback, or emptied a file, before)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from specdraft.config import ModelConfig, SamplingParams
from specdraft.errors import SpecdraftError
from specdraft.jsonl import read_jsonl, rewrite_jsonl
from tests.tiny import build_model

PROMPTS = [{"question_id": "q1", "category": "qa", "turns": ["what is a b c"]}]


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


def bench_settings(tmp_path, **changes):
    from specdraft.bench.options import BenchSettings

    return BenchSettings(prompts=str(prompts_file(tmp_path)), methods=("ar",), target="no-such-model-loads",
                         out=str(tmp_path / "run"), **changes)


# ---- sampling and threads ----

@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1180591620717411303424])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(SpecdraftError, match="seed must be between"):
        SamplingParams(temperature=1.0, seed=seed)


@pytest.mark.parametrize("seed", [0, -1, 2**64 - 1, -(2**63)])
def test_every_seed_torch_takes_is_accepted(seed):
    import torch

    SamplingParams(temperature=1.0, seed=seed)
    torch.Generator().manual_seed(seed)  # the range checked is torch's own


def test_negative_threads_are_refused():
    from specdraft.models.adapter import set_threads

    with pytest.raises(SpecdraftError, match="--threads must be >= 0"):
        ModelConfig(threads=-1)
    with pytest.raises(SpecdraftError, match="--threads must be >= 0"):
        set_threads(-1)
    ModelConfig(threads=0)  # 0: every core


# ---- bench ----

@pytest.mark.parametrize("mistake", [{"temperature": -1.0}, {"seed": 2**70}, {"threads": -2}])
def test_bench_overwrite_with_a_bad_setting_keeps_the_earlier_records(tmp_path, mistake):
    from specdraft.bench.runner import run_bench

    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text('{"question_id": "q1"}\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match="temperature|seed|threads"):  # not the target's name, checked later
        run_bench(bench_settings(tmp_path, overwrite=True, **mistake), progress=False)
    assert (run / "records.jsonl").read_text(encoding="utf-8") == '{"question_id": "q1"}\n'


def test_bench_out_that_is_a_file_is_refused_before_loading(tmp_path):
    from specdraft.bench.runner import run_bench

    (tmp_path / "run").write_text("mine", encoding="utf-8")
    with pytest.raises(SpecdraftError, match="is a file"):  # the target named cannot load: nothing was loaded
        run_bench(bench_settings(tmp_path), progress=False)
    assert (tmp_path / "run").read_text(encoding="utf-8") == "mine"


@pytest.mark.parametrize("content", ["{not json", "{}", "[1]", '{"settings": 3}'])
def test_bench_resume_from_a_broken_run_file_is_a_clear_error(tmp_path, content):
    from specdraft.bench.runner import run_bench

    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text('{"question_id": "q1"}\n', encoding="utf-8")
    (run / "run.json").write_text(content, encoding="utf-8")
    with pytest.raises(SpecdraftError, match="run.json is not a run file"):
        run_bench(bench_settings(tmp_path, resume=True), progress=False)


def test_bench_prompts_that_are_not_utf8_are_a_clear_error(tmp_path):
    from specdraft.bench.suite import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"question_id": "q\xff"}\n')
    with pytest.raises(SpecdraftError, match="not UTF-8"):
        load_prompts(str(path), None, None)


def test_a_prompt_holding_a_line_separator_stays_one_prompt(tmp_path):
    from specdraft.bench.suite import load_prompts

    path = tmp_path / "prompts.jsonl"
    row = {"question_id": "q1", "category": "qa", "turns": ["one\u2028two"]}
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_prompts(str(path), None, None)[0]["turns"] == ["one\u2028two"]


# ---- JSON lines that runs append to ----

def test_read_jsonl_drops_only_a_cut_last_line(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\n\n{"b": "x\u2028y"}\n{"c": ', encoding="utf-8")
    assert read_jsonl(path, "fix it") == ([{"a": 1}, {"b": "x\u2028y"}], True)
    path.write_text('{"a": 1}\n{"c": \n{"d": 4}\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match="line 2 is not JSON; fix it"):
        read_jsonl(path, "fix it")
    rewrite_jsonl(path, [{"a": 1}])
    assert read_jsonl(path, "fix it") == ([{"a": 1}], False)


# ---- models and heads ----

def test_a_model_with_cut_off_weights_is_a_clear_error(tmp_path):
    from specdraft.models.adapter import load_model

    folder = build_model(tmp_path / "m", seed=0)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecdraftError, match="could not load model"):
        load_model(str(folder), "float32", progress=False)


@pytest.mark.parametrize("damage", ["no tensors", "cut tensors", "broken config"])
def test_a_damaged_head_folder_is_a_clear_error(tmp_path, damage):
    from specdraft.drafters.eagle_head import EagleHeadConfig, read_head

    folder = tmp_path / "head"
    folder.mkdir()
    config = json.dumps(asdict(EagleHeadConfig(
        target="t", target_hidden_size=8, vocab_size=16, vocab_hash="x", target_layers=[0, 1, 2], hidden_size=8,
        intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4, draft_vocab_size=8)))
    (folder / "head.json").write_text("{not json" if damage == "broken config" else config, encoding="utf-8")
    if damage == "cut tensors":
        (folder / "head.safetensors").write_bytes(b"\x08\x00")
    with pytest.raises(SpecdraftError, match="could not be read"):
        read_head(str(folder))


def test_a_cache_folder_that_is_a_file_is_a_clear_error(tmp_path):
    from specdraft.models import fetch

    blocker = tmp_path / "cache"
    blocker.write_text("not a folder", encoding="utf-8")
    with pytest.raises(SpecdraftError, match="cannot create the model cache folder"):
        fetch._check_disk(blocker / "gguf", 1)


# ---- training settings ----

@pytest.mark.parametrize("change", [{"window": 0}, {"window": -5}, {"lr": -1.0}, {"lr": 0.0}, {"epochs": 0.0},
                                    {"checkpoint_every": 0}, {"validation_fraction": 1.0}, {"weight_decay": -1.0}])
def test_eagle_training_settings_are_checked(change):
    from specdraft.train.config import TrainConfig

    with pytest.raises(SpecdraftError):
        TrainConfig(data="x", out="y", **change)


@pytest.mark.parametrize("change", [{"lr": -1.0}, {"warmup_steps": -1}, {"grad_clip": 0.0}])
def test_sorted_training_settings_are_checked(change):
    from specdraft.train.config import SortedTrainConfig

    with pytest.raises(SpecdraftError):
        SortedTrainConfig(out="y", **change)


def test_training_defaults_pass_their_checks():
    from specdraft.train.config import SortedTrainConfig, TrainConfig

    TrainConfig(data="x", out="y")
    SortedTrainConfig(out="y")


# ---- chats files ----

@pytest.mark.parametrize("content", [
    '{"id": "q1", "messages": []}\n\n{"id": "q2"}\n{"id": "q3"}\n',  # rows of another kind after a blank line
    "question one\nquestion two\n",  # not JSON at all
    '[1, 2]\n',  # JSON, but no record
])
def test_train_chats_leaves_a_file_that_is_not_its_own_untouched(tmp_path, content):
    from specdraft.train.chats import ChatsConfig, generate

    path = tmp_path / "user.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecdraftError, match="not a chats file"):
        generate(ChatsConfig(out=str(path)), progress=False)
    assert path.read_text(encoding="utf-8") == content


def test_chats_reading_drops_a_cut_last_record(tmp_path):
    from specdraft.train.chats import _read

    path = tmp_path / "chats.jsonl"
    path.write_text('{"id": "q1", "messages": []}\n{"id": "q2", "mess', encoding="utf-8")
    records, cut = _read(path)
    assert [r["id"] for r in records] == ["q1"] and cut
    path.write_text('{"id": "q1", "mess', encoding="utf-8")  # killed while writing its first record: resumable
    assert _read(path) == ([], True)


# ---- answers ----

def test_answers_rows_must_be_objects(tmp_path):
    from specdraft.answers.runner import load_dataset

    path = tmp_path / "rows.jsonl"
    path.write_text('[{"id": "a"}]\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match="one JSON object"):
        load_dataset(str(path), None, 0)
    path.write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(SpecdraftError, match="not UTF-8"):
        load_dataset(str(path), None, 0)


def test_answers_out_that_is_a_file_is_refused(tmp_path):
    from specdraft.answers.runner import AnswersConfig, run

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "context": "c", "question": "q", "answers": ["x"]}) + "\n",
                    encoding="utf-8")
    (tmp_path / "out").write_text("mine", encoding="utf-8")
    with pytest.raises(SpecdraftError, match="is a file"):
        run(AnswersConfig(dataset=str(rows), out=str(tmp_path / "out")))
    assert (tmp_path / "out").read_text(encoding="utf-8") == "mine"


# ---- the Python API (a second audit: wrong types ended in TypeErrors inside torch, or wrong output) ----

@pytest.mark.parametrize("bad", [
    {"stop": "return"},  # a string would have stopped at each of its characters
    {"stop": ["ok", 3]}, {"max_new_tokens": 4.0}, {"max_new_tokens": "8"}, {"top_k": 2.5}, {"top_k": True},
    {"seed": 1.5}, {"temperature": None}, {"temperature": "0.5"}, {"temperature": float("inf")}, {"top_p": "1"},
])
def test_sampling_params_of_the_wrong_type_are_refused(bad):
    with pytest.raises(SpecdraftError, match="SamplingParams|stop must be"):
        SamplingParams(**{"temperature": 1.0, **bad})


@pytest.mark.parametrize("bad", [
    {"gamma": 4.5}, {"gamma": "4"}, {"draft_confidence": None}, {"tree_budget": "5"}, {"sorted_exits": "12,18"},
    {"sorted_exits": (12.0,)}, {"exit_rule": None}, {"method": None},
])
def test_spec_config_of_the_wrong_type_is_refused(bad):
    from specdraft.config import SpecConfig

    with pytest.raises(SpecdraftError, match="SpecConfig|unknown method"):
        SpecConfig(**bad)


def test_python_api_takes_the_cli_spellings_and_paths(tmp_path):
    from specdraft.config import SpecConfig

    spec = SpecConfig(gamma="auto", lookup_first="auto", draft_vocab="auto", sorted_exits=[8, 16],
                      eagle_head=tmp_path)
    assert (spec.gamma, spec.lookup_first, spec.setting("draft_vocab"), spec.setting("sorted_exits")) == (
        None, None, None, (8, 16))
    assert spec.setting("eagle_head") == str(tmp_path)
    assert ModelConfig(target=tmp_path, draft=None).target == str(tmp_path)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=(s for s in ["a"])).stop == ("a",)  # a generator, read once
    assert SamplingParams(stop=None).stop == ()


def test_numpy_scalars_are_taken_as_python_numbers():
    import numpy as np

    from specdraft.config import SpecConfig

    params = SamplingParams(temperature=np.float32(0.5), seed=np.int64(3), max_new_tokens=np.int64(4))
    assert (params.temperature, params.seed, params.max_new_tokens) == (0.5, 3, 4)
    assert type(params.seed) is int and type(params.temperature) is float
    assert SpecConfig(gamma=np.int64(3)).gamma == 3
    with pytest.raises(SpecdraftError, match="top_k must be an integer"):
        SamplingParams(top_k=np.bool_(True))


@pytest.mark.parametrize("bad", [{"dtype": None}, {"threads": "2"}, {"target": 5}])
def test_model_config_of_the_wrong_type_is_refused(bad):
    with pytest.raises(SpecdraftError, match="ModelConfig"):
        ModelConfig(**bad)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from specdraft.api import load_engine
    from specdraft.config import SpecConfig

    folder = build_model(tmp_path_factory.mktemp("api") / "m", seed=3)
    return load_engine(ModelConfig(target=str(folder), draft=None, dtype="float32", threads=1),
                       SpecConfig(method="ar"), progress=False)


@pytest.mark.parametrize("prompt", [[-5, 3], [1.5, 2.0], [10**9], ["12"], "abc", [True, 3], None, 5,
                                    __import__("torch").tensor([[3, 4]]), __import__("numpy").array([[3, 4]]), []])
def test_generate_refuses_prompts_that_are_not_token_ids(tiny_engine, prompt):
    with pytest.raises(SpecdraftError, match="token id|token ids|1-D|empty"):
        tiny_engine.generate(prompt, SamplingParams(max_new_tokens=2))


def test_generate_takes_ids_as_a_list_a_tensor_or_numpy(tiny_engine):
    import numpy as np
    import torch

    params = SamplingParams(max_new_tokens=3)
    expected = tiny_engine.generate([3, 4, 5], params).token_ids
    assert tiny_engine.generate(torch.tensor([3, 4, 5]), params).token_ids == expected
    assert tiny_engine.generate(np.array([3, 4, 5]), params).token_ids == expected


def test_encode_and_load_engine_refuse_wrong_types(tiny_engine):
    from specdraft.api import load_engine
    from specdraft.config import SpecConfig

    with pytest.raises(SpecdraftError, match="encode takes one prompt as a string"):
        tiny_engine.encode(["a", "b"], chat=False)
    with pytest.raises(SpecdraftError, match="messages must be a list"):
        tiny_engine.encode_messages("hi")
    with pytest.raises(SpecdraftError, match="must be a SpecConfig"):
        load_engine(ModelConfig(), "draft")
    with pytest.raises(SpecdraftError, match="must be a loaded model"):
        load_engine(ModelConfig(), SpecConfig(method="ar"), target="qwen2.5-coder-1.5b-instruct")


@pytest.mark.parametrize("models, spec, expected", [
    (ModelConfig(target="no/such/model/here"), "ar", "unknown model"),
    (ModelConfig(draft="/nonexistent/draft"), "draft", "unknown model"),
    (ModelConfig(), "eagle", "needs a trained head"),
])
def test_mistyped_models_and_missing_heads_fail_before_any_model_loads(monkeypatch, models, spec, expected):
    from specdraft import api
    from specdraft.config import SpecConfig

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(api, "load_model", no_loading)
    with pytest.raises(SpecdraftError, match=expected):
        api.load_engine(models, SpecConfig(method=spec))
