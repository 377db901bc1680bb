"""Several sequences in one target pass (NativeLlama.forward_many): each gets bit for bit the logits it gets
alone, whatever else is in the pass, on float32, bf16 and GGUF block weights."""

from __future__ import annotations

import pytest
import torch

from specdraft import load_model
from specdraft.models.adapter import NativeState
from specdraft.models.native.llama import MAX_KERNEL_ROWS
from specdraft.types import Draft

PROMPTS = ([5, 9, 13, 2, 7, 7, 1], [3, 3, 3], [11, 4, 8, 1, 6, 2, 12, 8, 1, 10, 6], [2])  # the tiny vocabulary: 14


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def native_target(tiny_dirs, request):
    return load_model(str(tiny_dirs["target"]), dtype=request.param, backend="native")


def prefilled(model, prompt):
    state = model.new_state(capacity=64)
    state.forward(prompt, 1)
    return state


def check_passes_match_alone(model, reduced_heads: bool = False):
    """Rounds of passes of uneven lengths over sequences of uneven contexts: batched == alone, bit for bit.
    reduced_heads: some sequences score only some rows of the head (a draft vocabulary's), two of them the same
    rows object, one its own, one the whole head."""
    generator = torch.Generator().manual_seed(0)
    batched = [prefilled(model, p) for p in PROMPTS]
    alone = [prefilled(model, p) for p in PROMPTS]
    if reduced_heads:
        head = model.native.full_head()
        shared, own = head[torch.tensor([0, 2, 3, 7, 13])], head[torch.tensor([1, 5, 6])]
        for states in (batched, alone):
            for state, rows in zip(states, (shared, None, own, shared)):
                state.lm_head = rows
    for round_ in range(3):
        lengths = [1 + (round_ + i) % 4 for i in range(len(PROMPTS))]  # 1..4 tokens per sequence
        ids = [torch.randint(0, 14, (n,), generator=generator).tolist() for n in lengths]
        n_logits = [n if i % 2 else 1 for i, n in enumerate(lengths)]
        together = NativeState.forward_many(batched, ids, n_logits)
        for state, chain, n, got in zip(alone, ids, n_logits, together):
            assert torch.equal(got, state.forward(chain, n)), (round_, chain)
    assert [s.token_ids for s in batched] == [s.token_ids for s in alone]
    # the caches too: the next single step of each agrees
    for a, b in zip(batched, alone):
        assert torch.equal(a.forward([7], 1), b.forward([7], 1))


def test_a_pass_of_several_sequences_gives_each_its_own_logits(native_target):
    check_passes_match_alone(native_target)


def test_sequences_scoring_their_own_head_rows_share_a_pass(native_target):
    """A draft model's requests, each with its draft vocabulary's rows (batched drafting)."""
    check_passes_match_alone(native_target, reduced_heads=True)


def test_a_pass_of_several_sequences_on_gguf_blocks(tmp_path):
    from tiny import build_model
    from tiny_gguf import write_gguf

    hf = build_model(tmp_path / "hf", seed=21, hidden=64, layers=2)
    model = load_model(str(write_gguf(hf, tmp_path / "cache", "tiny-q8", "Q8_0")), dtype="gguf")
    assert model.native.full_head().padding == 2  # 14 rows: repacked with 2 rows of zeros (`interleave(pad=True)`)
    check_passes_match_alone(model)
    check_passes_match_alone(model, reduced_heads=True)


def test_verify_many_keeps_each_sequence_as_its_own_verify_would(native_target):
    batched = [prefilled(native_target, p) for p in PROMPTS]
    alone = [prefilled(native_target, p) for p in PROMPTS]
    drafts = [Draft(torch.tensor(chain, dtype=torch.long)) for chain in ([4, 5], [], [9, 9, 9], [1])]
    pendings = [p[-1] for p in PROMPTS]
    together = NativeState.verify_many(batched, pendings, drafts)
    for state, pending, draft, got in zip(alone, pendings, drafts, together):
        assert torch.equal(got, state.verify(pending, draft))
    accepted = [[0], [], [0, 1], []]
    for a, b, nodes in zip(batched, alone, accepted):
        a.keep_verified(nodes)
        b.keep_verified(nodes)
        assert a.token_ids == b.token_ids and torch.equal(a.forward([3], 1), b.forward([3], 1))


def test_a_prompt_chunk_riding_in_others_passes_fills_its_cache_as_its_own_passes_would(native_target):
    """The server's prefill chunks ride in the running requests' verify pass (n_logits 0): the riding prompt's
    next step, and the others' logits, are bit for bit those of separate passes."""
    prompt = [(3 * i + 1) % 14 for i in range(20)]
    verifying = [prefilled(native_target, p) for p in PROMPTS[:2]]
    alone = [prefilled(native_target, p) for p in PROMPTS[:2]]
    rider, own = native_target.new_state(capacity=64), native_target.new_state(capacity=64)
    drafts = [Draft(torch.tensor(chain, dtype=torch.long)) for chain in ([4, 5], [9])]
    pendings = [p[-1] for p in PROMPTS[:2]]
    for chunk in (prompt[:8], prompt[8:19]):  # two chunks: the second attends over the first
        assert rider.rides_along(verifying[0], len(chunk))
        together = NativeState.verify_many(verifying, pendings, drafts, (rider, chunk))
        own.forward(chunk, 1)
        for state, pending, draft, got in zip(alone, pendings, drafts, together):
            assert torch.equal(got, state.verify(pending, draft))
        for states in (verifying, alone):
            for state in states:
                state.keep_verified([])
    assert rider.token_ids == own.token_ids == prompt[:19]
    assert torch.equal(rider.forward(prompt[19:], 1), own.forward(prompt[19:], 1))


def test_forward_many_refuses_what_it_cannot_pass_exactly(native_target):
    one, two = prefilled(native_target, PROMPTS[0]), prefilled(native_target, PROMPTS[1])
    too_long = [1] * (MAX_KERNEL_ROWS + 1)  # float32 matrices: a pass of its own this long takes torch's matmul
    if native_target.native.rows_batch_invariant:
        assert one.rides_along(two, len(too_long))
    else:
        assert not one.rides_along(two, len(too_long))
        with pytest.raises(ValueError, match="1 to 32 tokens"):
            NativeState.forward_many([one, two], [too_long, [2]], [1, 1])
    with pytest.raises(ValueError, match="one pass per cache"):
        native_target.native.forward_many([([1], one.cache, 1), ([2], one.cache, 1)])
    with pytest.raises(ValueError, match="verifies chains"):
        NativeState.verify_many([one], [1], [Draft(torch.tensor([1, 2]), None, torch.tensor([-1, -1]))])


def test_many_rows_stay_on_the_invariant_kernels_and_the_negative_control_fails(tiny_dirs, monkeypatch):
    """40 rows in one pass: past the 32 rows where a float32 pass alone would take torch's matmul. forward_many
    keeps every row on the batch-invariant kernels; letting the pass size choose (the negative control) changes
    the logits."""
    from specdraft.models.native.llama import NativeLlama

    model = load_model(str(tiny_dirs["target"]), dtype="float32", backend="native")
    prompts = [[1 + (i * 5 + j) % 13 for j in range(3 + i % 4)] for i in range(10)]
    ids = [[(i + j) % 14 for j in range(4)] for i in range(10)]

    def batched_equals_alone() -> bool:
        together = NativeState.forward_many([prefilled(model, p) for p in prompts], ids, [4] * 10)
        alone = [prefilled(model, p).forward(chain, 4) for p, chain in zip(prompts, ids)]
        return all(torch.equal(a, b) for a, b in zip(together, alone))

    assert batched_equals_alone()
    linear = NativeLlama._linear
    monkeypatch.setattr(NativeLlama, "_linear", lambda self, x, w, b, kernel_only=False: linear(self, x, w, b))
    assert not batched_equals_alone()


# ---------------------------------------------------------------------------------------- Engine.generate_many

ENGINE_PROMPTS = ("abc abc abc ab", "ba", "cab cab c", "aaaa bbbb aaaa b")


@pytest.mark.parametrize("method", ["ar", "prompt-lookup", "draft"])
def test_requests_decoded_together_get_what_each_gets_alone(tiny_models, method, monkeypatch):
    """Greedy and seeded sampling, plain decoding, a stateless drafter and a drafter with per-request state (one
    instance each): every request's tokens equal its own `generate`, on both backends (transformers: one pass
    per request); on the native one the draft model drafts for several requests at once."""
    from specdraft import SamplingParams, SpecConfig
    from specdraft.api import load_engine
    from specdraft.config import ModelConfig
    from specdraft.drafters import ModelDrafter

    batches = []
    propose_batch = ModelDrafter.propose_batch.__func__
    monkeypatch.setattr(ModelDrafter, "propose_batch", classmethod(
        lambda cls, drafters, *rest: batches.append(len(drafters)) or propose_batch(cls, drafters, *rest)))
    spec = SpecConfig(method=method, gamma=3)
    engine = load_engine(ModelConfig(), spec, progress=False, target=tiny_models["target"],
                         draft=tiny_models["draft"])
    prompts = [engine.encode(p, chat=False) for p in ENGINE_PROMPTS]
    for params in ([SamplingParams(max_new_tokens=12)] * 4,
                   [SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed) for seed in (1, 2, 3, 4)]):
        together = engine.generate_many(prompts, params)
        for prompt, p, got in zip(prompts, params, together):
            alone = engine.generate(prompt, p)
            assert (got.token_ids, got.text) == (alone.token_ids, alone.text)
            assert got.stats.target_passes == alone.stats.target_passes
            assert got.stats.finish_reason == alone.stats.finish_reason
    if method == "draft" and tiny_models["draft"].native is not None:
        assert batches and max(batches) > 1


def test_a_failing_batch_of_drafts_falls_back_to_one_by_one(tiny_models, monkeypatch, caplog):
    """A batched proposal that raises is logged and each request drafts alone: the outputs stay each one's own."""
    from specdraft import SamplingParams, SpecConfig
    from specdraft.api import load_engine
    from specdraft.config import ModelConfig
    from specdraft.drafters import ModelDrafter

    def broken(cls, *args):
        raise RuntimeError("a broken batch")

    engine = load_engine(ModelConfig(), SpecConfig(method="draft", gamma=3, lookup_first=0), progress=False,
                         target=tiny_models["target"], draft=tiny_models["draft"])
    prompts = [engine.encode(p, chat=False) for p in ENGINE_PROMPTS]
    params = SamplingParams(max_new_tokens=12)
    alone = [engine.generate(p, params).token_ids for p in prompts]
    monkeypatch.setattr(ModelDrafter, "propose_batch", classmethod(broken))
    with caplog.at_level("WARNING", logger="specdraft.engine"):
        together = [r.token_ids for r in engine.generate_many(prompts, params)]
    assert together == alone
    assert ("a broken batch" in caplog.text) == (tiny_models["draft"].native is not None)


def test_a_drafter_with_state_needs_a_builder_to_be_shared(tiny_models):
    from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError
    from specdraft.drafters import ModelDrafter

    engine = Engine(tiny_models["target"], ModelDrafter(tiny_models["draft"], tiny_models["target"]),
                    SpecConfig("draft", 2))
    ids = engine.encode("abc", chat=False)
    with pytest.raises(SpecdraftError, match="keeps one sequence's state"):
        engine.generate_many([ids, ids], SamplingParams(max_new_tokens=4))
    assert engine.generate_many([ids], SamplingParams(max_new_tokens=4))[0].token_ids == engine.generate(
        ids, SamplingParams(max_new_tokens=4)).token_ids


def test_the_equality_check_catches_logits_handed_to_the_wrong_request(tiny_dirs, monkeypatch):
    """Negative control for the test above: a batch that gives each request another's logits must be caught."""
    from specdraft import SamplingParams, SpecConfig
    from specdraft.api import load_engine
    from specdraft.config import ModelConfig

    model = load_model(str(tiny_dirs["target"]), dtype="float32", backend="native")
    engine = load_engine(ModelConfig(), SpecConfig(method="ar"), progress=False, target=model)
    prompts = [engine.encode(p, chat=False) for p in ENGINE_PROMPTS]
    params = SamplingParams(max_new_tokens=12)
    alone = [engine.generate(p, params).token_ids for p in prompts]
    verify_many = NativeState.verify_many
    monkeypatch.setattr(NativeState, "verify_many", staticmethod(
        lambda states, pendings, drafts, prefill=None: verify_many(states, pendings, drafts, prefill)[::-1]))
    assert [r.token_ids for r in engine.generate_many(prompts, params)] != alone


@pytest.mark.parametrize("draft_weights", ["float32", "gguf"])
def test_one_draft_model_drafts_for_several_requests_in_one_pass(tiny_dirs, monkeypatch, tmp_path, draft_weights):
    """ModelDrafter.propose_batch: each request gets the draft its own `propose` gives (greedy, and sampled with its
    own generator), whatever its catch-up (one of over 32 tokens goes alone first), length or confidence cut, with
    the draft model's steps shared (forward_many), each request scoring its own draft vocabulary (a GGUF draft's:
    its fixed rows repacked, `SplitRows`)."""
    from specdraft import SamplingParams
    from specdraft.drafters import ModelDrafter
    from specdraft.drafters.vocab import SplitRows
    from tiny_gguf import write_gguf

    target = load_model(str(tiny_dirs["target"]), dtype="float32", backend="native")
    if draft_weights == "gguf":
        draft = load_model(str(write_gguf(tiny_dirs["draft"], tmp_path / "cache", "tiny-draft-q8", "Q8_0")),
                           dtype="gguf")
        reduced = ModelDrafter(draft, target, draft_vocab=8).vocab.weight
        assert isinstance(reduced, SplitRows) and reduced.fixed.interleaved
    else:
        draft = load_model(str(tiny_dirs["draft"]), dtype="float32", backend="native")
    contexts = [[5, 9, 13, 2, 7], [3, 3], [(i * 7) % 14 for i in range(40)], [2, 11, 4]]
    ks = [3, 1, 4, 2]
    passes = []
    forward_many = NativeState.forward_many
    monkeypatch.setattr(NativeState, "forward_many", staticmethod(
        lambda states, ids, n: passes.append(len(states)) or forward_many(states, ids, n)))

    def drafters(confidence: float) -> list[ModelDrafter]:
        made = [ModelDrafter(draft, target, min_confidence=confidence, draft_vocab=v) for v in (0, 8, 8, 0)]
        for drafter, context in zip(made, contexts):
            drafter.begin(context[:2])
        return made

    for confidence in (0.0, 0.3):
        for params in ([SamplingParams()] * 4, [SamplingParams(temperature=1.0, seed=s) for s in range(4)]):
            def generators():
                return [torch.Generator().manual_seed(s) for s in range(4)]

            passes.clear()
            together = ModelDrafter.propose_batch(drafters(confidence), contexts, ks, params, generators())
            assert passes and max(passes) > 1  # steps shared
            alone = [d.propose(c, k, p, g) for d, c, k, p, g in zip(drafters(confidence), contexts, ks, params,
                                                                     generators())]
            for got, want in zip(together, alone):
                assert torch.equal(got.token_ids, want.token_ids)
                assert (got.draft_probs is None) == (want.draft_probs is None)
                assert got.draft_probs is None or torch.equal(got.draft_probs, want.draft_probs)
            assert [d.k for d in together] != [0] * 4
