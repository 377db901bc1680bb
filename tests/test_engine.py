"""The loop on tiny random Hugging Face models: greedy equality, rollback, stops, budgets, seeds, errors."""

from __future__ import annotations

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError, load_model
from specdraft.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdraft.drafters.lookup_first import LOOKUP_LABEL, LookupFirstDrafter
from specdraft.types import Draft

PROMPTS = ["abc ab", "j. ihg", "a", "dead beef cafe. dead be"]
GREEDY = SamplingParams(max_new_tokens=24)


def ar_engine(models) -> Engine:
    return Engine(models["target"])


def draft_engine(models, gamma: int = 4, draft: str = "draft") -> Engine:
    return Engine(models["target"], ModelDrafter(models[draft], models["target"]), SpecConfig("draft", gamma))


class WrongDrafter(Drafter):
    """Always proposes a token the target's greedy choice is not: zero acceptance."""

    name = "wrong"

    def __init__(self, target):
        self.target = target

    def begin(self, prompt_ids, features=None):
        pass

    def propose(self, context_ids, k, params, generator):
        logits = self.target.model(torch.tensor([context_ids])).logits[0, -1]
        return Draft(torch.full((k,), (int(logits.argmax()) + 1) % logits.shape[-1], dtype=torch.long))

    def on_accept(self, context_ids, features=None):
        pass


def test_our_autoregressive_matches_transformers_generate(tiny_models):
    engine = ar_engine(tiny_models)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        ours = engine.generate(ids, GREEDY).token_ids
        hf = tiny_models["target"].model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        eos = tiny_models["target"].eos_token_ids
        hf = hf[: next((i for i, t in enumerate(hf) if t in eos), len(hf))]
        assert ours == hf, prompt


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_draft_partial_acceptance_equals_autoregressive(tiny_models, gamma):
    for prompt in PROMPTS:
        ids = ar_engine(tiny_models).encode(prompt, chat=False)
        expected = ar_engine(tiny_models).generate(ids, GREEDY)
        got = draft_engine(tiny_models, gamma).generate(ids, GREEDY)
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text


def test_greedy_with_confidence_stopped_drafts_equals_autoregressive(tiny_models):
    engine = Engine(tiny_models["target"], ModelDrafter(tiny_models["draft"], tiny_models["target"], 0.3),
                    SpecConfig("draft", 6, draft_confidence=0.3))
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids
    assert got.stats.drafted < 6 * got.stats.target_passes  # some drafts really stopped early


@pytest.mark.parametrize("context_tokens", [1, 3])
def test_a_draft_model_reading_the_prompts_end_only_stays_greedy_exact(tiny_models, context_tokens):
    """draft_context: the draft model reads only the prompt's last tokens (with its first proposal) and follows the
    context from there (starting over on its last tokens whenever more went by unseen); the output is plain
    decoding's, and the draft's cache never holds the whole prompt."""
    target = tiny_models["target"]
    drafter = ModelDrafter(tiny_models["draft"], target, context_tokens=context_tokens)
    engine = Engine(target, drafter, SpecConfig("draft", 3, draft_context=context_tokens, lookup_first=0))
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        got = engine.generate(ids, GREEDY)
        assert got.token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids, prompt
        assert got.stats.drafted > 0
        window = min(context_tokens, len(ids))
        assert drafter.context_start >= len(ids) - window
        # the draft has seen a window and the tokens since (not the last one: it is fed at the next proposal)
        assert len(drafter.state) <= len(ids) + len(got.token_ids) - drafter.context_start
    with torch.inference_mode():
        drafter.begin(list(range(2, 12)))
        assert (drafter.context_start, len(drafter.state)) == (10 - context_tokens, 0)  # nothing fed yet
        drafter.propose(list(range(2, 12)), 1, GREEDY, None)  # the window and the pending token in one pass
    assert len(drafter.state) == context_tokens


@pytest.mark.parametrize("context_tokens", [0, 3])
def test_a_draft_models_read_before_its_guess_is_what_it_then_feeds(tiny_models, context_tokens):
    """`reads_before_guess` (what gamma auto prices in a shared pass) counts what `to_feed` then feeds, without
    feeding it: after a proposal and an acceptance, after a rest of several tokens (past a window: its restart),
    and before the drafter has begun (its catch-up). A copy of lookup first reads nothing."""
    target = tiny_models["target"]
    drafter = ModelDrafter(tiny_models["draft"], target, context_tokens=context_tokens)
    prompt = list(range(2, 12))
    assert drafter.reads_before_guess(prompt, len(prompt), begun=False) == drafter.catch_up_tokens(10, 10)
    with torch.inference_mode():
        drafter.begin(prompt)
        context = list(prompt)
        for rest in (0, 1, 5):  # tokens that went by unseen since the last proposal
            context += [(3 * len(context)) % 12 + 2 for _ in range(rest + 1)]
            before = (list(drafter.state.token_ids), drafter.context_start)
            reads = drafter.reads_before_guess(context, len(prompt), begun=True)
            assert (list(drafter.state.token_ids), drafter.context_start) == before  # nothing fed, nothing dropped
            assert reads == len(drafter.to_feed(context)) > 0, rest
            drafter.propose(context, 1, GREEDY, None)
    lookup = LookupFirstDrafter(drafter, max_ngram=4, min_ngram=2)
    copyable = prompt + prompt[:3]  # its last 2-gram occurs earlier: the next proposal copies
    assert lookup.next_source(copyable) == LOOKUP_LABEL and lookup.reads_before_guess(copyable, 10, True) == 0


def test_greedy_full_acceptance_with_target_as_its_own_draft(tiny_models):
    engine = draft_engine(tiny_models, 4, draft="target")
    ids = engine.encode("abc ab", chat=False)
    got = engine.generate(ids, GREEDY)
    assert got.token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids
    assert got.stats.accepted == got.stats.drafted > 0
    assert got.stats.tau > 4.0  # 5 tokens per pass except where the budget cut the draft


def test_greedy_zero_acceptance_still_equals_autoregressive(tiny_models):
    engine = Engine(tiny_models["target"], WrongDrafter(tiny_models["target"]), SpecConfig("draft", 3))
    ids = engine.encode("abc ab", chat=False)
    got = engine.generate(ids, GREEDY)
    assert got.token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids
    assert got.stats.accepted == 0 and got.stats.drafted > 0
    assert got.stats.target_passes == len(got.token_ids)


def test_a_drafter_needs_only_its_three_methods_and_anything_else_is_refused(tiny_models):
    """The Drafter base declares every optional member with a default (WrongDrafter sets none of them); an object
    that is not a Drafter is refused with a clear error, not an AttributeError mid-generation."""
    drafter = WrongDrafter(tiny_models["target"])
    assert (drafter.feature_layers, drafter.draft_bytes, drafter.budget, drafter.source_bytes) == ((), 0, None, {})
    assert drafter.next_source([1, 2]) is None

    class NotADrafter:
        name = "duck"

    with pytest.raises(SpecdraftError, match="must be a specdraft Drafter"):
        Engine(tiny_models["target"], NotADrafter(), SpecConfig("draft", 3))


def test_prompt_lookup_greedy_equals_autoregressive(tiny_models):
    engine = Engine(tiny_models["target"], PromptLookupDrafter(), SpecConfig("prompt-lookup", 4))
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        assert engine.generate(ids, GREEDY).token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids


def ngram_index_mismatches(index_class) -> int:
    """Random contexts over small vocabularies (repeats everywhere), grown token by token and in jumps, then
    replaced by contexts that do not extend them, for every (max, min) n-gram pair up to 4: how many times an
    index of `index_class` drafted otherwise than the scan of the whole context (find_continuation)."""
    from specdraft.drafters.prompt_lookup import find_continuation

    rng = torch.Generator().manual_seed(0)
    mismatches = 0
    for max_ngram in range(1, 5):
        for min_ngram in range(1, max_ngram + 1):
            for trial in range(8):
                vocab = 2 + trial % 4
                index = index_class(max_ngram, min_ngram)
                context = torch.randint(0, vocab, (int(torch.randint(1, 50, (1,), generator=rng)),),
                                        generator=rng).tolist()
                for replaced in range(2):
                    grown: list[int] = []
                    while len(grown) < len(context):
                        grown = context[: len(grown) + int(torch.randint(1, 5, (1,), generator=rng))]
                        index.update(grown)
                        mismatches += sum(index.continuation(k) != find_continuation(grown, k, max_ngram, min_ngram)
                                          for k in (1, 3, 100))
                    context = torch.randint(0, vocab, (len(context) + 3,), generator=rng).tolist()  # not its own
    return mismatches


def test_ngram_index_finds_what_the_scan_of_the_whole_context_finds():
    """NgramIndex against its slow twin find_continuation; a shared prompt lookup drafter serving interleaved
    sequences drafts for each what the scan drafts. Negative control: an index that keeps the n-grams of a context
    that its new one does not extend fails the same comparison."""
    from specdraft.drafters.prompt_lookup import NgramIndex, find_continuation

    assert ngram_index_mismatches(NgramIndex) == 0

    class Stale(NgramIndex):  # takes every context for an extension of the one it indexed
        def extended_by(self, context_ids):
            return len(context_ids) >= len(self.ids)

    assert ngram_index_mismatches(Stale) > 0

    rng = torch.Generator().manual_seed(1)
    shared = PromptLookupDrafter(3, 1)
    sequences = [[1, 2, 3, 1, 2], [2, 2, 1, 2, 2], [3, 1, 2, 3, 1]]
    for step in range(12):
        for sequence in sequences:
            sequence.append(int(torch.randint(0, 4, (1,), generator=rng)))
            got = shared.propose(sequence, 4, GREEDY, None).token_ids.tolist()
            assert got == find_continuation(sequence, 4, 3, 1)
    assert len(shared.indexes) == len(sequences)


def test_cache_rollback_gives_the_same_logits_as_a_fresh_pass(tiny_models):
    model = tiny_models["target"]
    tokens = [2, 3, 4, 5, 6, 7, 8, 9]
    with torch.inference_mode():
        state = model.new_state()
        state.forward(tokens, 1)
        state.truncate(5)
        assert len(state) == 5 and state.cache_length == 5
        after_rollback = state.forward([9, 10], 2)
        fresh = model.new_state().forward(tokens[:5] + [9, 10], 2)
    torch.testing.assert_close(after_rollback, fresh, rtol=1e-5, atol=1e-5)


def test_sync_keeps_common_prefix_and_returns_the_rest(tiny_models):
    with torch.inference_mode():
        state = tiny_models["target"].new_state()
        state.forward([2, 3, 4, 5], 1)
        assert state.sync([2, 3, 9, 9, 9]) == [9, 9, 9]
        assert state.token_ids == [2, 3] and state.cache_length == 2


@pytest.mark.parametrize("budget", [1, 2, 5, 7])
def test_max_new_tokens_is_exact_with_speculation(tiny_models, budget):
    engine = draft_engine(tiny_models, 4, draft="target")  # full acceptance: passes overshoot unless capped
    ids = engine.encode("abc ab", chat=False)
    result = engine.generate(ids, SamplingParams(max_new_tokens=budget))
    assert len(result.token_ids) == budget and result.stats.finish_reason == "length"


def test_stop_string_ends_generation_before_it(tiny_models):
    ids = ar_engine(tiny_models).encode("dead beef cafe. dead be", chat=False)
    full = ar_engine(tiny_models).generate(ids, SamplingParams(max_new_tokens=30)).text
    stop = full[6:8]
    assert stop, "the tiny model's output is too short for this test"
    for engine in (ar_engine(tiny_models), draft_engine(tiny_models, 4)):
        result = engine.generate(ids, SamplingParams(max_new_tokens=30, stop=(stop,)))
        assert result.text == full[: full.index(stop)]
        assert stop in engine.target.tokenizer.decode(result.token_ids)  # the tokens end at the stop
        assert stop not in engine.target.tokenizer.decode(result.token_ids[:-1])
        assert result.stats.finish_reason == "stop"


def test_stop_rule_ends_generation_at_the_first_token_that_satisfies_it(tiny_models):
    """stop_when holds first after some token: the request ends with that token, its text whole, whether the pass
    brought one token (ar) or several (a draft that the target always accepts), alone or with others."""
    ids = ar_engine(tiny_models).encode("dead beef cafe. dead be", chat=False)
    full = ar_engine(tiny_models).generate(ids, SamplingParams(max_new_tokens=30))
    tokenizer = tiny_models["target"].tokenizer
    texts = [tokenizer.decode(full.token_ids[:n], skip_special_tokens=True) for n in range(len(full.token_ids) + 1)]
    cut = 7  # a rule that first holds with the 7th token: the text has grown past the 6-token text's length
    assert len(texts[cut]) > len(texts[cut - 1]), "the tiny model's output is too short for this test"

    def rule(text: str) -> bool:
        return len(text) >= len(texts[cut])

    def full_acceptance() -> ModelDrafter:  # the draft is the target: every pass brings 5 tokens
        return ModelDrafter(tiny_models["target"], tiny_models["target"])

    speculative = Engine(tiny_models["target"], full_acceptance(), SpecConfig("draft", 4), new_drafter=full_acceptance)
    for engine in (ar_engine(tiny_models), speculative):
        result = engine.generate(ids, SamplingParams(max_new_tokens=30), stop_when=rule)
        assert result.token_ids == full.token_ids[:cut] and result.text == texts[cut]
        assert result.stats.finish_reason == "stop"
        together = engine.generate_many([ids, ids], SamplingParams(max_new_tokens=30), stop_when=rule)
        assert [r.token_ids for r in together] == [full.token_ids[:cut]] * 2
    wrong = ar_engine(tiny_models).generate(ids, SamplingParams(max_new_tokens=30), stop_when=lambda text: False)
    assert wrong.token_ids == full.token_ids and wrong.stats.finish_reason == "length"
    with pytest.raises(SpecdraftError, match="stop_when"):
        ar_engine(tiny_models).stream(ids, GREEDY, stop_when="\n")


def test_streamed_chunks_concatenate_to_the_final_text(tiny_models):
    engine = draft_engine(tiny_models, 3)
    ids = engine.encode("abc ab", chat=False)
    generation = engine.stream(ids, SamplingParams(max_new_tokens=20, stop=("zz",)))
    chunks = [chunk.text for chunk in generation]
    assert "".join(chunks) == generation.result().text
    assert len(chunks) > 1


def test_eos_stops_generation_and_is_not_emitted(tiny_dirs):
    target = load_model(str(tiny_dirs["target"]), "float32")
    ids = Engine(target).encode("abc ab", chat=False)
    free_run = Engine(target).generate(ids, SamplingParams(max_new_tokens=12)).token_ids
    eos = free_run[5]
    target.model.generation_config.eos_token_id = eos
    result = Engine(target).generate(ids, SamplingParams(max_new_tokens=12))
    assert result.token_ids == free_run[: free_run.index(eos)]
    assert result.stats.finish_reason == "stop"


def test_same_seed_same_sample_and_different_seeds_differ(tiny_models):
    engine = draft_engine(tiny_models, 3)
    ids = engine.encode("abc ab", chat=False)
    params = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed) for seed in (7, 7, 8)]
    first, again, other = (engine.generate(ids, p).token_ids for p in params)
    assert first == again
    assert first != other


def test_statistics_are_consistent(tiny_models):
    result = draft_engine(tiny_models, 4).generate(ar_engine(tiny_models).encode("abc ab", chat=False), GREEDY)
    s = result.stats
    assert s.new_tokens == len(result.token_ids)
    assert s.accepted == sum(s.accepted_per_position) and s.drafted == sum(s.drafted_per_position)
    assert 0.0 <= s.alpha <= 1.0 and 1.0 <= s.predicted_tau <= 5.0
    assert s.time_total_s >= s.time_draft_s + s.time_verify_s


def test_incompatible_vocabularies_raise_a_clear_error(tmp_path, tiny_models):
    from tiny import build_model

    other = load_model(str(build_model(tmp_path / "other", seed=4, chars="klmnop")), "float32")
    with pytest.raises(SpecdraftError, match="incompatible vocabularies"):
        ModelDrafter(other, tiny_models["target"])


def test_llama_architecture_works_as_a_draft(tiny_models):
    ids = ar_engine(tiny_models).encode("abc ab", chat=False)
    got = draft_engine(tiny_models, 3, draft="llama").generate(ids, GREEDY)
    assert got.token_ids == ar_engine(tiny_models).generate(ids, GREEDY).token_ids


def test_empty_prompt_and_overlong_request_are_user_errors(tiny_models):
    engine = ar_engine(tiny_models)
    with pytest.raises(SpecdraftError, match="empty"):
        engine.encode("   ", chat=False)
    with pytest.raises(SpecdraftError, match="context"):
        engine.stream([2] * 500, SamplingParams(max_new_tokens=100))


def test_result_before_the_generation_ran_is_an_error(tiny_models):
    engine = Engine(tiny_models["target"])
    generation = engine.stream([2, 3, 4], SamplingParams(max_new_tokens=3, temperature=0))
    with pytest.raises(SpecdraftError, match="has not run yet"):
        generation.result()
    text = "".join(chunk.text for chunk in generation)
    assert generation.result().text == text


class CountingDrafter(Drafter):
    """Drafts nothing useful; counts its calls."""

    name = "counting"

    def __init__(self, catches_up: bool):
        self.catches_up = catches_up
        self.begins = self.accepts = 0

    def begin(self, prompt_ids, features=None):
        self.begins += 1

    def propose(self, context_ids, k, params, generator):
        return Draft(torch.tensor([context_ids[-1]] * k, dtype=torch.long))

    def on_accept(self, context_ids, features=None):
        self.accepts += 1


class NeverDraft:
    most = 3

    def next(self, source=None, context_tokens=0, load=None, reads=1):
        return 0

    def token_cost(self, source=None):
        return 0.0

    def observe(self, drafted, accepted, source=None):
        pass


@pytest.mark.parametrize("catches_up", [True, False])
def test_a_drafter_that_catches_up_is_begun_at_its_first_proposal(tiny_models, catches_up):
    """A request whose passes never draft never pays such a drafter's prefill; one that does not catch up begins
    with the prompt, as before."""
    from specdraft.engine import DecodeLoop
    from specdraft.types import SpecStats

    drafter = CountingDrafter(catches_up)
    loop = DecodeLoop(tiny_models["target"], drafter, [2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0),
                      NeverDraft(), None, SpecStats())
    with torch.inference_mode():
        while not loop.finished:
            loop.accept(loop.state.verify(loop.pending, loop.propose()))
    assert (drafter.begins, drafter.accepts) == ((0, 0) if catches_up else (1, 4))


class DraftFromSecondPass(NeverDraft):
    def __init__(self):
        self.passes = 0

    def next(self, source=None, context_tokens=0, load=None, reads=1):
        self.passes += 1
        return 0 if self.passes == 1 else 2


@pytest.mark.parametrize("max_new_tokens, begun", [(12, True), (4, False)])
def test_a_drafter_begun_late_reads_the_prompt_only_when_enough_tokens_are_left(tiny_models, max_new_tokens, begun):
    """The first pass drafts nothing; at the second the drafter is begun with the prompt (and catches up on the
    token since) when the tokens left are at least the context's length, else that pass drafts nothing. The
    greedy output is plain decoding's either way."""
    from specdraft.engine import DecodeLoop
    from specdraft.types import SpecStats

    target = tiny_models["target"]
    prompt = [2, 3, 4, 5, 6]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    drafter = CountingDrafter(catches_up=True)
    loop = DecodeLoop(target, drafter, prompt, params, DraftFromSecondPass(), None, SpecStats())
    emitted = []
    with torch.inference_mode():
        while not loop.finished:
            emitted += loop.accept(loop.state.verify(loop.pending, loop.propose()))
    assert drafter.begins == int(begun)
    expected = Engine(target).generate(prompt, params).token_ids  # it stops at an EOS; the loop goes on
    assert emitted[:len(expected)] == expected


@pytest.mark.parametrize("context_tokens, begun", [(0, False), (2, True)])
def test_a_late_begin_counts_what_the_drafter_would_read(tiny_models, context_tokens, begun):
    """A draft model reading at most 2 unseen tokens catches up cheaply: begun late with 6 tokens left where one
    reading the whole 9-token prompt is not. Prompt lookup reads nothing to catch up. Output is plain decoding's
    either way."""
    from specdraft.engine import DecodeLoop
    from specdraft.types import SpecStats

    target = tiny_models["target"]
    prompt = [2, 3, 4, 5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_new_tokens=7, temperature=0)
    drafter = ModelDrafter(tiny_models["draft"], target, context_tokens=context_tokens)
    assert drafter.catch_up_tokens(9, 10) == (10 if context_tokens == 0 else 2)
    assert PromptLookupDrafter().catch_up_tokens(9, 10) == 0
    loop = DecodeLoop(target, drafter, prompt, params, DraftFromSecondPass(), None, SpecStats())
    emitted = []
    with torch.inference_mode():
        while not loop.finished:
            emitted += loop.accept(loop.state.verify(loop.pending, loop.propose()))
    assert loop.drafter_begun == begun and (loop.stats.drafted > 0) == begun
    expected = Engine(target).generate(prompt, params).token_ids  # it stops at an EOS; the loop goes on
    assert emitted[:len(expected)] == expected


class DraftEveryFifthPass(NeverDraft):
    def __init__(self):
        self.passes = 0

    def next(self, source=None, context_tokens=0, load=None, reads=1):
        self.passes += 1
        return 2 if self.passes % 5 == 1 else 0


@pytest.mark.parametrize("context_tokens", [0, 3])
def test_a_draft_model_that_rested_starts_over_on_the_contexts_last_tokens(tiny_models, context_tokens):
    """Drafting every fifth pass, a draft reading at most 3 unseen tokens starts over on the context's last 3
    (its cache holds those and its drafts, nothing before); one with no limit catches up on everything. The output
    is plain decoding's either way."""
    from specdraft.engine import DecodeLoop
    from specdraft.types import SpecStats

    target = tiny_models["target"]
    prompt = [2, 3, 4, 5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    drafter = ModelDrafter(tiny_models["draft"], target, context_tokens=context_tokens)
    loop = DecodeLoop(target, drafter, prompt, params, DraftEveryFifthPass(), None, SpecStats())
    emitted, starts = [], []
    with torch.inference_mode():
        while not loop.finished:
            draft = loop.propose()
            if draft.k:  # the draft's cache: the context from its start, then the drafts it fed (all but the last)
                start = drafter.context_start
                assert drafter.state.token_ids == loop.context[start:] + draft.token_ids.tolist()[:-1]
                starts.append((start, len(loop.context)))
            emitted += loop.accept(loop.state.verify(loop.pending, draft))
    assert len(starts) >= 3
    if context_tokens:  # each proposal after a rest of four passes starts over on the context's last 3 tokens
        assert all(start == length - 3 for start, length in starts)
    else:
        assert all(start == 0 for start, _ in starts)
    expected = Engine(target).generate(prompt, params).token_ids
    assert emitted[:len(expected)] == expected
