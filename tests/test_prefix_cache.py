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


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
        if corrupt:  # the shared prefix's keys in reverse order against its values: each key meets another
            # position's value (keys and values flipped together would only reorder whole pairs, which a query after
            # the prefix sums in any order: the logits then differ by rounding alone, or not at all)
            n = len(SHARED)
            for entry in cache._entries.values():
                keys = entry.kv.keys  # [layers, kv_heads, positions, head_dim]
                keys[:, :, :n] = keys[:, :, :n].flip(2).clone()
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
    # first round: SHARED from the first prompt, then SHARED + [20] from the second; second round: every prompt
    # was cached whole but its last token (the first pending token)
    rounds = [(SamplingParams(max_new_tokens=12, temperature=0.0), [0, len(SHARED), len(SHARED) + 1]),
              (SamplingParams(max_new_tokens=12, temperature=1.0, seed=7), [len(p) - 1 for p in prompts])]
    for params, reused in rounds:
        got = [cached.generate(prompt, params) for prompt in prompts]
        assert [r.token_ids for r in got] == [plain.generate(prompt, params).token_ids for prompt in prompts]
        assert [r.stats.cached_prompt_tokens for r in got] == reused


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
    # a server's way: the prompt in chunks of 4, the cache asked at the first, then decoded to the end
    prompt = SHARED + [7, 7, 7, 7, 7, 7, 7]
    generation = engine.stream(prompt, params)
    with torch.inference_mode():
        loop = generation.open(prefill_by_chunks=True)
        while not loop.prefill(4):
            pass
        ended = False
        while not ended:
            _, ended = generation.accept(loop.state.verify(loop.pending, loop.propose()))
        generation.close()
    assert generation.stats.cached_prompt_tokens == len(SHARED)
    assert generation.result().token_ids == plain.generate(prompt, params).token_ids


def test_entries_live_in_least_recently_used_order_within_the_budget(targets):
    model = targets["gguf"]
    with torch.inference_mode():
        def holding(token_ids):
            state = model.new_state(capacity=64)
            state.forward(token_ids, 1)
            return state

        state = holding(SHARED + [1, 2, 3, 4, 5, 6])
        per_token = state.prefix_bytes(1)
        cache = PrefixCache(per_token * 30)
        cache.store(state, SHARED[:10])
        cache.store(state, SHARED)  # extends the first: takes its place
        assert len(cache) == 1 and cache.nbytes == per_token * len(SHARED)
        first, second, third = [40, 41, 42, 43, 44], [35, 36, 37, 38], [30, 31, 32, 33, 34, 35, 36]
        cache.store(holding(first), first)
        cache.store(holding(second), second)
        assert len(cache) == 3 and cache.nbytes == per_token * 27
        assert cache.restore(model.new_state(capacity=64), SHARED + [9]) == len(SHARED)  # SHARED: the newest use
        cache.store(holding(third), third)  # 34 tokens: the least recently used (`first`) goes, SHARED stays
        assert cache.nbytes == per_token * 29
        assert cache.restore(model.new_state(capacity=64), first) == 0
        assert cache.restore(model.new_state(capacity=64), second) == len(second)
        assert cache.restore(model.new_state(capacity=64), SHARED) == len(SHARED)
        cache.store(state, [])  # nothing to keep
        assert len(cache) == 3
        tiny = PrefixCache(per_token * 4)
        tiny.store(state, SHARED)  # larger than the whole budget: not kept
        assert len(tiny) == 0
    with pytest.raises(SpecdraftError, match="budget"):
        PrefixCache(-1)
    with pytest.raises(SpecdraftError, match="PrefixCache"):
        Engine(model, prefix_cache=object())


def test_a_cache_shared_by_two_models_gives_each_only_its_own_entries(targets):
    """The same tokens through bf16 and GGUF weights: K/V of the same shape, other values. Each model's states
    take only what that model stored; an entry of the same tokens from the other model gives way."""
    bf16, gguf = targets["bfloat16"], targets["gguf"]
    cache = PrefixCache(1 << 24)
    with torch.inference_mode():
        state = bf16.new_state(capacity=64)
        state.forward(SHARED, 1)
        cache.store(state, SHARED)
        assert cache.restore(gguf.new_state(capacity=64), SHARED + [1]) == 0
        assert cache.restore(bf16.new_state(capacity=64), SHARED + [1]) == len(SHARED)
        state = gguf.new_state(capacity=64)
        state.forward(SHARED, 1)
        cache.store(state, SHARED)
        assert len(cache) == 1 and cache.restore(gguf.new_state(capacity=64), SHARED + [1]) == len(SHARED)
        assert cache.restore(bf16.new_state(capacity=64), SHARED + [1]) == 0
