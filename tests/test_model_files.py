"""The packaged folders read without transformers (models/model_files.py) give what transformers gives: the same
token ids both ways, the same text back, the same chat-template text, the same config values, on every packaged
model; and the comparison fails for a tokenizer that differs in one step of its pipeline (negative control)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdraft.drafters import ModelDrafter
from specdraft.models import fetch
from specdraft.models.adapter import load_model, load_tokenizer
from specdraft.models.model_files import FastTokenizer, JsonConfig, read_generation_config, read_model_config
from specdraft.models.native.llama import rotary_frequencies

pytestmark = pytest.mark.real

PACKAGED = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
PROMPTS = Path(__file__).parent.parent / "data" / "bench" / "prompts.jsonl"
EDGE_TEXTS = [
    "", " ", "  leading and trailing  ", "\n\n\tindented\n", "a\r\nb", "x" * 300, "1234567890 3.14159 -42",
    "def f(x):\n    return x ** 2  # square\n", "naïve café résumé", "cafe\u0301 (decomposed)", "Ｆｕｌｌｗｉｄｔｈ",
    "日本語のテキスト、句読点。", "Привет, мир!", "emoji 🙂👍🏽 and ZWJ 👨‍👩‍👧", "tab\there", "<|im_start|>user",
    "text <|im_end|> inside", "<|endoftext|>", "<s> </s> <unk>", "don't won't I'm", "  spaced   out   words  ",
    "\u00a0non-breaking\u2009thin", "control \x07 bell", "Ⅻ ligature ﬁ", "mixed\nnew\n\nlines\n\n\n",
]


def corpus() -> list[str]:
    texts = list(EDGE_TEXTS)
    for line in PROMPTS.read_text().splitlines():
        texts.extend(json.loads(line)["turns"])
    return texts


@pytest.fixture(scope="module", params=PACKAGED)
def folder(request) -> Path:
    return fetch.fetch(request.param, progress=False)


@pytest.fixture(scope="module")
def pair(folder):
    from transformers import AutoTokenizer

    fast = FastTokenizer.from_folder(folder)
    assert fast is not None, f"{folder.name}: the packaged tokenizer is read without transformers"
    return fast, AutoTokenizer.from_pretrained(str(folder))


def differences(fast, reference, texts) -> list[str]:
    """What the two tokenizers do differently on `texts`: ids with and without special tokens, text back."""
    found = []
    for text in texts:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special)["input_ids"]
            if fast(text, add_special_tokens=special)["input_ids"] != ids:
                found.append(f"encode {text!r} special={special}")
            for skip in (True, False):
                if fast.decode(ids, skip_special_tokens=skip) != reference.decode(ids, skip_special_tokens=skip):
                    found.append(f"decode {text!r} skip={skip}")
    return found


def test_same_ids_and_text_as_transformers(pair):
    fast, reference = pair
    assert differences(fast, reference, corpus()) == []
    assert fast.eos_token_id == reference.eos_token_id and fast.pad_token_id == reference.pad_token_id
    assert fast.bos_token_id == reference.bos_token_id
    assert fast.get_vocab() == reference.get_vocab() and len(fast) == len(reference)
    assert fast.all_special_ids == sorted(reference.all_special_ids)  # a reduced draft vocabulary keeps these
    assert ({i: token.content for i, token in fast.added_tokens_decoder.items()}
            == {i: token.content for i, token in reference.added_tokens_decoder.items()})


def test_random_ids_decode_alike(pair):
    fast, reference = pair
    generator = random.Random(0)
    size = json.loads((Path(fast.name_or_path) / "config.json").read_text())["vocab_size"]  # the logits' width:
    assert size >= len(reference)  # a model may emit ids past the tokenizer's entries
    for _ in range(200):
        ids = [generator.randrange(size) for _ in range(generator.randrange(1, 40))] + [size - 1]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids
    assert fast.decode(torch.tensor([1, 2, 3])) == reference.decode([1, 2, 3]) and fast.decode(5) == reference.decode(5)


def test_same_chat_template_text_and_ids(pair):
    fast, reference = pair
    turns = [line["turns"] for line in map(json.loads, PROMPTS.read_text().splitlines())][:12]
    conversations = [[{"role": "user", "content": t[0]}] for t in turns]
    conversations += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": t[0]},
                       {"role": "assistant", "content": "Sure."}, {"role": "user", "content": t[-1]}] for t in turns]
    for messages in conversations:
        for generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=generation_prompt)
            assert (fast.apply_chat_template(messages, tokenize=False, **kwargs)
                    == reference.apply_chat_template(messages, tokenize=False, **kwargs))
            assert (fast.apply_chat_template(messages, return_dict=False, **kwargs)
                    == reference.apply_chat_template(messages, return_dict=False, **kwargs))
            assert (fast.apply_chat_template(messages, **kwargs)["input_ids"]
                    == reference.apply_chat_template(messages, **kwargs)["input_ids"])


PROBE_TEMPLATE = ("{{ messages|tojson }}|{{ tools|tojson }}|{{ documents|tojson }}|{{ bos_token }}|{{ eos_token }}|"
                  "{{ unk_token }}|{{ pad_token }}|{{ add_generation_prompt }}|{{ extra }}")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_what_a_template_sees_is_what_transformers_passes(pair, tmp_path):
    """A probe template in a second folder that shares the first one's vocabulary (the draft's path): messages with
    None values, older reasoning names, non-ASCII and markup; tools; documents; the special tokens; a variable."""
    from transformers import AutoTokenizer

    fast, _ = pair
    folder = Path(fast.name_or_path)
    probe = tmp_path / "probe"
    probe.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (probe / name).write_bytes((folder / name).read_bytes())
    (probe / "chat_template.jinja").write_text(PROBE_TEMPLATE)
    first = load_tokenizer(str(folder), without_transformers=True)
    shared = load_tokenizer(str(probe), without_transformers=True)
    assert isinstance(shared, FastTokenizer) and shared.backend is first.backend and shared.chat_template == PROBE_TEMPLATE
    reference = AutoTokenizer.from_pretrained(str(probe))
    messages = [{"role": "system", "content": "Ünïcode <b>&amp;</b> \"quoted\"", "name": None},
                {"role": "user", "content": "What's the weather?", "tool_calls": None},
                {"role": "assistant", "content": "Let me look.", "thinking": "a city is needed"},
                {"role": "tool", "content": "{\"temp\": 21}", "reasoning": None}]
    kwargs = dict(tools=[TOOL], documents=[{"title": "t <1>", "text": "naïve"}], add_generation_prompt=True,
                  extra=("x", 1, 2.5, None, True))
    assert shared.apply_chat_template(messages, tokenize=False, **kwargs) == reference.apply_chat_template(
        messages, tokenize=False, **kwargs)
    assert shared.apply_chat_template(messages, return_dict=False, **kwargs) == reference.apply_chat_template(
        messages, return_dict=False, **kwargs)


def test_tool_calls_render_alike(pair):
    fast, reference = pair
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 °C"}]
    for tools in (None, [TOOL]):
        assert (fast.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
                == reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True))


def test_arguments_it_cannot_honour_are_refused(pair):
    fast, _ = pair
    messages = [{"role": "user", "content": "hi"}]
    assert fast.apply_chat_template(messages, continue_final_message=False, padding=False)["input_ids"]
    for kwargs in (dict(continue_final_message=True), dict(return_tensors="pt"), dict(chat_template="{{ 1 }}")):
        with pytest.raises(NotImplementedError):
            fast.apply_chat_template(messages, **kwargs)
    with pytest.raises(NotImplementedError):
        fast.apply_chat_template([messages, messages])
    with pytest.raises(ValueError):
        fast.apply_chat_template(messages, tools=[print])


def test_negative_control_a_pipeline_that_splits_words_differently_differs(pair):
    from tokenizers.pre_tokenizers import WhitespaceSplit

    fast, reference = pair
    broken = FastTokenizer.from_folder(Path(fast.name_or_path))  # its own backend, not the shared one
    broken.backend.pre_tokenizer = WhitespaceSplit()
    assert differences(broken, reference, corpus()), "the comparison must notice another pre-tokenizer"


def test_same_config_values_as_transformers(folder):
    from transformers import AutoConfig, GenerationConfig

    config, reference = read_model_config(folder), AutoConfig.from_pretrained(str(folder))
    assert isinstance(config, JsonConfig)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act",
                "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        assert getattr(config, key) == getattr(reference, key), key
    # what the native backend reads with a default (llama.py): the same value with that default
    for key, default in (("head_dim", None), ("layer_types", None), ("use_sliding_window", False),
                         ("mlp_bias", False), ("pretraining_tp", 1)):
        assert getattr(config, key, default) == getattr(reference, key, default), key
    rope = [getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) for c in (config, reference)]
    assert rope[0] == rope[1]
    ours, theirs = rotary_frequencies(config), rotary_frequencies(reference)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    generation = read_generation_config(folder, config)
    assert generation.eos_token_id == GenerationConfig.from_pretrained(str(folder)).eos_token_id


def test_a_packaged_gguf_loads_without_importing_transformers(tmp_path):
    """In a fresh interpreter: loading the 1.5B and generating imports no transformers module."""
    import subprocess
    import sys

    code = ("import sys\nfrom specdraft import load_model, Engine, SamplingParams\n"
            "m = load_model('qwen2.5-coder-1.5b-instruct', progress=False)\n"
            "e = Engine(m)\nr = e.generate(e.encode('Say hi'), SamplingParams(max_new_tokens=2))\n"
            "print(type(m.tokenizer).__name__, type(m.config).__name__, len(r.token_ids),\n"
            "      any(name.split('.')[0] == 'transformers' for name in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.split() == ["FastTokenizer", "JsonConfig", "2", "False"], out.stderr[-2000:]


def test_folders_it_does_not_vouch_for_go_to_transformers(tmp_path, folder):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        (other / name).write_bytes((folder / name).read_bytes())
    settings = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(settings, tokenizer_class="LlamaTokenizer")))
    assert FastTokenizer.from_folder(other) is None
    assert not isinstance(load_tokenizer(str(other), without_transformers=True), FastTokenizer)
    for changed in (dict(settings, add_prefix_space=True), dict(settings, chat_template="{{ x }}"),
                    dict(settings, eos_token={"content": "<|im_end|>", "special": True}),
                    dict(settings, eos_token="<not in the vocabulary>")):
        (other / "tokenizer_config.json").write_text(json.dumps(changed))
        assert FastTokenizer.from_folder(other) is None, changed
    (other / "tokenizer_config.json").write_text(json.dumps(settings))
    assert isinstance(FastTokenizer.from_folder(other), FastTokenizer)  # the unchanged copy is read
    (other / "chat_template.jinja").write_text("{% generation %}{{ messages }}{% endgeneration %}")
    assert FastTokenizer.from_folder(other) is None  # transformers' own tag
    values = json.loads((other / "config.json").read_text())
    assert isinstance(read_model_config(other), JsonConfig)
    for changed in (dict(values, transformers_version="4.57.0"), dict(values, num_key_value_heads=None),
                    dict(values, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})):
        (other / "config.json").write_text(json.dumps(changed))
        assert read_model_config(other) is None, changed
    del values["rope_parameters"]
    (other / "config.json").write_text(json.dumps(values))
    assert read_model_config(other) is None
    (other / "generation_config.json").write_text("not json")
    assert read_generation_config(other, read_model_config(folder)) is None
    (other / "chat_template.jinja").write_bytes((folder / "chat_template.jinja").read_bytes())
    (other / "tokenizer.json").write_text("{not a tokenizer")
    assert FastTokenizer.from_folder(other) is None  # the library's own error: transformers reports it instead


def test_target_and_draft_share_one_vocabulary(tmp_path):
    target = load_model("qwen2.5-coder-1.5b-instruct", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", progress=False)
    assert isinstance(target.tokenizer, FastTokenizer) and target.tokenizer.backend is draft.tokenizer.backend
    assert target.tokenizer.chat_template != draft.tokenizer.chat_template  # each folder keeps its own
    drafter = ModelDrafter(draft, target)  # its reduced head keeps the end of a turn, past the first 32,768 ids
    assert drafter.vocab is not None and 151645 in drafter.vocab.always_extra
