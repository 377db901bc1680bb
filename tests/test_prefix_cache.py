"""The prefix cache (prefix_cache.py): a prompt's K/V restored from an earlier prompt that began the same way give
the very logits and tokens of a whole prefill, on every state that says so (native bf16 and GGUF); float32
weights prefill whole; entries live in least-recently-used order within their budget. Negative control: K/V that
are not the prefix's must change the logits the same check compares."""

from __future__ import annotations

import pytest
import torch

from specdraft import Engine, ModelConfig, PrefixCache, SamplingParams, SpecConfig, load_engine, load_model
from specdraft.errors import SpecdraftError
from tiny import build_model

SHARED = [5, 9, 14, 3, 22, 7, 11, 30, 2, 17, 8, 25, 4, 19, 6, 13, 27, 10]  # a "system prompt" of 18 tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """The same tiny Qwen2 as bf16 and float32 weights on the native backend, and as a Q8_0 GGUF."""
    from tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("prefix")
    hf = build_model(root / "hf", seed=31, vocab_size=48, hidden=64, layers=2)
    gguf_dir = write_gguf(hf, root / "cache", "tiny-prefix", "Q8_0")
    return {"bfloat16": load_model(str(hf), "bfloat16", progress=False),
            "float32": load_model(str(hf), "float32", progress=False),
            "gguf": load_model(str(gguf_dir), "gguf", progress=False)}


def whole_and_restored(model, prompt: list[int], other: list[int], corrupt: bool = False):
    """The last 3 positions' logits of `prompt` prefilled whole, and prefilled after the prefix it shares with
    `other`, restored from a cache that prefilled `other` (corrupt: that entry's K/V scrambled first)."""
    with torch.inference_mode():
        whole = model.new_state(capacity=64).forward(prompt, 3)
        cache = PrefixCache(1 << 24)
        first = model.new_state(capacity=64)
        first.forward(other, 1)
        cache.store(first, other)
        if corrupt:
            for entry in cache._entries.values():
                entry.kv = tuple(kv.flip(2) for kv in entry.kv)  # the right values at the wrong positions
        state = model.new_state(capacity=64)
        restored = cache.restore(state, prompt)
        logits = state.forward(prompt[restored:], 3)
    return whole, logits, restored


@pytest.mark.parametrize("dtype", ["bfloat16", "gguf"])
def test_a_restored_prefix_gives_the_logits_of_a_whole_prefill(targets, dtype):
    prompt, other = SHARED + [1, 2, 3, 4, 5], SHARED + [29, 28, 27]
    whole, logits, restored = whole_and_restored(targets[dtype], prompt, other)
    assert restored == len(SHARED)
    assert torch.equal(whole, logits)


@pytest.mark.parametrize("dtype", ["bfloat16", "gguf"])
def test_negative_control_other_kv_for_the_prefix_change_the_logits(targets, dtype):
    prompt, other = SHARED + [1, 2, 3, 4, 5], SHARED + [29, 28, 27]
    whole, logits, restored = whole_and_restored(targets[dtype], prompt, other, corrupt=True)
    assert restored == len(SHARED)
    assert not torch.equal(whole, logits)


def test_float32_weights_prefill_every_prompt_whole(targets):
    """Their passes over more than 32 tokens take torch's matmul, whose rows depend on the pass."""
    model = targets["float32"]
    cache = PrefixCache(1 << 24)
    with torch.inference_mode():
        state = model.new_state(capacity=64)
        state.forward(SHARED, 1)
        cache.store(state, SHARED)
        assert len(cache) == 0 and cache.restore(model.new_state(capacity=64), SHARED + [1]) == 0


@pytest.mark.parametrize("method", ["ar", "prompt-lookup"])
@pytest.mark.parametrize("dtype", ["bfloat16", "gguf"])
def test_an_engine_with_a_prefix_cache_gives_what_one_without_gives(targets, dtype, method):
    """Greedy and seeded sampling, three prompts in turn (the second and third begin as the first, the third
    extends the second like a conversation's next turn): the same tokens as an engine that prefills whole,
    with the prompt tokens the cache gave counted."""
    model = targets[dtype]
    spec, models = SpecConfig(method=method, gamma=3), ModelConfig(target="unused", threads=1)
    plain = load_engine(models, spec, progress=False, target=model)
    cached = load_engine(models, spec, progress=False, target=model, prefix_cache=PrefixCache(1 << 24))
    prompts = [SHARED + [1, 2, 3], SHARED + [20, 21], SHARED + [20, 21, 9, 9, 9, 12]]
    for params in (SamplingParams(max_new_tokens=12, temperature=0.0),
                   SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)):
        for prompt in prompts:
            expected = plain.generate(prompt, params)
            got = cached.generate(prompt, params)
            assert got.token_ids == expected.token_ids
            assert expected.stats.cached_prompt_tokens == 0
    # second round: every prompt was cached whole but its last token (the first pending token)
    assert got.stats.cached_prompt_tokens == len(prompts[-1]) - 1


def test_generate_many_and_chunked_prefill_take_the_cache(targets):
    model = targets["gguf"]
    spec = SpecConfig(method="ar", gamma=0)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    cache = PrefixCache(1 << 24)
    engine = Engine(model, spec=spec, prefix_cache=cache)
    prompts = [SHARED + [1, 2], SHARED + [3, 4], SHARED + [5]]
    results = engine.generate_many(prompts, params)
    assert [r.stats.cached_prompt_tokens for r in results] == [0, len(SHARED), len(SHARED)]
    plain = Engine(model, spec=spec)
    assert [r.token_ids for r in results] == [plain.generate(p, params).token_ids for p in prompts]
    # a server's way: the prompt in chunks of 4, the cache asked at the first
    generation = engine.stream(SHARED + [7, 7, 7, 7, 7, 7, 7], params)
    loop = generation.open(prefill_by_chunks=True)
    while not loop.prefill(4):
        pass
    assert generation.stats.cached_prompt_tokens == len(SHARED)
    generation.close()


def test_entries_live_in_least_recently_used_order_within_the_budget(targets):
    model = targets["gguf"]
    with torch.inference_mode():
        state = model.new_state(capacity=64)
        state.forward(SHARED + [1, 2, 3, 4, 5, 6], 1)
        per_token = state.prefix_bytes(1)
        cache = PrefixCache(per_token * 30)
        cache.store(state, SHARED[:10])
        cache.store(state, SHARED)  # extends the first: takes its place
        assert len(cache) == 1 and cache.nbytes == per_token * len(SHARED)
        other = model.new_state(capacity=64)
        other.forward([40, 41, 42, 43, 44, 45, 46, 47], 1)
        cache.store(other, [40, 41, 42, 43, 44, 45, 46, 47])
        assert len(cache) == 2 and cache.nbytes == per_token * 26
        assert cache.restore(model.new_state(capacity=64), SHARED + [9]) == len(SHARED)  # now the newest use
        cache.store(state, SHARED + [1, 2, 3, 4, 5, 6])  # 24 tokens: the oldest use goes first
        assert len(cache) == 1 and cache.nbytes == per_token * 24
        assert cache.restore(model.new_state(capacity=64), [40, 41, 42]) == 0
        cache.store(state, [])  # nothing to keep
        tiny = PrefixCache(per_token * 4)
        tiny.store(state, SHARED)  # larger than the whole budget: not kept
        assert len(tiny) == 0
    with pytest.raises(SpecdraftError, match="budget"):
        PrefixCache(-1)
    with pytest.raises(SpecdraftError, match="PrefixCache"):
        Engine(model, prefix_cache=object())
