"""gamma auto (draft_length.py, models/verify_curve.py): the length rule on crafted curves, the per-request
policy, the measured and cached curve, exactness of the loop when each pass picks its length, and the knobs."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError, load_model
from specdraft.bench.options import BenchSettings, add_bench_arguments, parse_method, settings_from_args
from specdraft.bench.methods import HF_AUTO_GAMMA
from specdraft.bench.report import gamma_label
from specdraft.bench.report import predicted_tau as report_predicted_tau
from specdraft.bench.runner import plan_variants
from specdraft.config import AUTO_GAMMA_MAX
from specdraft.draft_length import (EXTRAPOLATED_SPANS, READ_SLOPE, AdaptiveLength, FixedLength, PassLoad,
                                    VerifyCurve, best_length, expected_tokens, pass_cost_at, read_cost)
from specdraft.drafters import ModelDrafter, PromptLookupDrafter
from specdraft.drafters.lookup_first import LOOKUP_LABEL, LookupFirstDrafter
from specdraft.knobs import parse_gamma
from specdraft.types import DRAFTER_SOURCE, SpecStats

FLAT = (1.0,) * 9  # a pass over 9 tokens costs what a pass over 1 does
STEEP = tuple(1.0 + 0.5 * n for n in range(9))  # every extra token costs half a pass


def test_expected_tokens_is_the_geometric_chain():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("alpha, curve, draft_cost, expected", [
    (0.9, FLAT, 0.0, 8),     # free verification, free drafts: draft as far as allowed
    (0.2, FLAT, 0.0, 8),     # still free: a longer draft never loses
    (0.6, STEEP, 0.0, 1),    # tokens that cost half a pass each, kept 60 % of the time: one
    (0.2, STEEP, 0.0, 0),    # ... kept 20 % of the time: none, a plain pass (1.2 tokens for 1.5 passes loses)
    (0.9, STEEP, 0.0, 3),    # likely ones: several, until their cost outruns alpha^k
    (0.9, FLAT, 0.4, 4),     # a draft model's own steps cost: fewer than with free drafts (8)
    (0.5, FLAT, 0.4, 1),
    (0.5, FLAT, 0.6, 0),     # a costly drafter at even odds: its step costs more than the half token it brings
    (0.96, FLAT, 0.8, 2),    # nearly always right at 0.8 of a pass (self-speculation's deepest exit): still drafts
])
def test_best_length_weighs_acceptance_against_cost(alpha, curve, draft_cost, expected):
    assert best_length(alpha, curve, draft_cost) == expected
    # the choice is the argmax of tokens per unit of time (k = 0: one token per pass): no other length does better
    rate = lambda k: expected_tokens(alpha, k) / (curve[k] + k * draft_cost)  # noqa: E731
    assert all(rate(expected) >= rate(k) for k in range(0, len(curve)))


# the Zen 3's measured GGUF curve (docs/performance.md), T(n) / T(1) for n = 1 .. 9
ZEN3 = (1.0, 1.06, 1.22, 1.48, 1.87, 2.11, 2.37, 2.62, 2.9)


def test_pass_cost_is_extrapolated_along_the_curves_last_slope():
    assert pass_cost_at(STEEP, 3) == STEEP[2]
    assert pass_cost_at(STEEP, 9 + 4) == pytest.approx(STEEP[-1] + 4 * 0.5)
    assert pass_cost_at(FLAT, 40) == 1.0


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.95])
def test_a_fuller_pass_drafts_less(alpha):
    """In a batched pass the other requests' tokens sit on the curve first: this request's extra rows cost what the
    curve charges at the pass's width, so a full pass drafts less than an empty one, and nothing once a row costs
    more than it brings. An empty load is the single-request choice."""
    assert best_length(alpha, ZEN3, 0.0, PassLoad()) == best_length(alpha, ZEN3, 0.0)
    lengths = [best_length(alpha, ZEN3, 0.0, PassLoad(tokens=n, requests=n)) for n in range(0, 33)]
    assert lengths[0] > 0 and max(lengths[12:]) < lengths[0]
    assert lengths[-1] == 0  # 32 others: each extra row costs ~0.28 passes, for < 0.9 tokens
    # the choice is the argmax of the whole pass's tokens per unit of time, k = 0 included
    load = PassLoad(tokens=6, requests=4, draft_cost=0.5)
    rate = lambda k: (4 + expected_tokens(alpha, k)) / (pass_cost_at(ZEN3, 7 + k) + 0.5)  # noqa: E731
    chosen = best_length(alpha, ZEN3, 0.0, load)
    assert all(rate(chosen) >= rate(k) for k in range(len(ZEN3)))


def test_a_read_before_the_guess_is_charged_to_drafting_at_all_in_a_shared_pass():
    """A draft model that must first read what it has not seen (its window when it begins, or what went by while
    it rested) makes every request in a shared pass wait: that read is charged to any k > 0. Alone it is left to
    the measured token cost (the single-request choice as before); a one-token read is the step itself."""
    curve = VerifyCurve.flat(ZEN3)
    assert read_cost(0.1, 1) == read_cost(0.1, 0) == 0.0 and read_cost(0.1, 16) == pytest.approx(0.1 * READ_SLOPE * 15)
    shared = PassLoad(tokens=1, requests=1)
    for alpha in (0.6, 0.8):
        policy = AdaptiveLength(curve, {}, lambda: 0.1, prior_alpha=alpha)
        plain = best_length(alpha, ZEN3, 0.1, shared)
        assert plain > 0 and policy.next(load=shared, reads=1) == plain
        assert policy.next(load=shared, reads=16) == 0  # the 16-token read, 0.3 of a pass, before any draft
        assert best_length(alpha, ZEN3, 0.1, shared, read_cost=read_cost(0.1, 16)) == 0
        assert policy.next(reads=16) == policy.next(reads=1) == best_length(alpha, ZEN3, 0.1) > 0  # alone: unpriced
    # a read that does not change the argmax leaves the choice: a cheap read before a sure draft
    assert best_length(0.95, ZEN3, 0.1, shared, read_cost=0.05) == best_length(0.95, ZEN3, 0.1, shared) > 0


def test_a_resting_source_is_forgotten_pass_by_pass_until_it_drafts_again():
    """A costly drafter that keeps missing stops drafting (k = 0); the passes without a draft decay its tally,
    so its estimate drifts back toward the prior and it tries again. A source that merely found nothing to
    draft (no prompt-lookup match) keeps its tally: that pass was not the policy's choice."""
    curve = VerifyCurve.flat(1.0 + 0.02 * n for n in range(9))
    policy = AdaptiveLength(curve, {"lookup": 0.0}, lambda: 0.5)
    assert policy.next() == 1  # the prior (0.6) pays for one token at half a pass
    for _ in range(4):  # four one-token drafts rejected (asked for one even where the policy has begun to rest)
        policy.observe(1, 0)
    assert policy.next() == 0 and policy.alpha() < 0.3
    low = policy.alpha()
    idle = 0
    while policy.next() == 0:
        policy.observe(0, 0)
        idle += 1
        assert idle < 20, "a resting source must try again"
    # 10 here: its evidence (2.7 examined tokens) fades below one token; its estimate alone would take 21
    assert policy.alpha() > low and 1 <= idle <= 12
    # a source never rests on the prior alone: priced above what the prior pays for, it still tries one token
    costly = AdaptiveLength(curve, {}, lambda: 0.9)
    assert best_length(costly.alpha(), curve.at(0), 0.9) == 0 and costly.next() == 1
    costly.observe(1, 1)  # kept: evidence now, but a 0.9 step does not pay at 0.73
    assert costly.next() == 0
    # lookup found no match: no evidence, no forgetting (it was never told to rest)
    policy.observe(3, 0, "lookup")
    before = policy.alpha("lookup")
    policy.observe(0, 0, "lookup")
    assert policy.alpha("lookup") == before


def test_the_policy_lengthens_after_acceptances_and_shortens_after_rejections():
    # T(n) grows 10 % a token
    policy = AdaptiveLength(VerifyCurve.flat(1.0 + 0.1 * n for n in range(7)), {}, lambda: 0.0)
    assert policy.most == 6
    start = policy.next()
    for _ in range(6):  # every draft token kept
        policy.observe(policy.next(), policy.next())
    long = policy.next()
    for _ in range(12):  # every first draft token rejected
        policy.observe(policy.next(), 0)
    short = policy.next()
    assert short == 1 < start < long <= 6
    before = policy.alpha()
    policy.observe(0, 0)  # nothing drafted (no prompt-lookup match): no evidence
    assert policy.alpha() == before
    assert FixedLength(3).next() == FixedLength(3).most == 3


def test_the_curve_follows_the_context_length():
    """Linear in the context between the two measured curves, the short one below the short context, capped
    extrapolation past the long one, never falling with n (a noisy long curve cannot make longer passes cheaper)."""
    curve = VerifyCurve(short=(1.0, 1.0, 1.1), long=(1.0, 1.4, 1.3), short_context=64, long_context=512)
    assert curve.at(0) == curve.at(64) == (1.0, 1.0, 1.1)
    assert curve.at(288) == pytest.approx((1.0, 1.2, 1.2))  # halfway; n = 3 kept at n = 2's cost
    assert curve.at(512) == pytest.approx((1.0, 1.4, 1.4))
    far = 64 + EXTRAPOLATED_SPANS * 448
    assert curve.at(int(far)) == pytest.approx((1.0, 1.0 + 0.4 * EXTRAPOLATED_SPANS, 1.0 + 0.4 * EXTRAPOLATED_SPANS))
    assert curve.at(10 * int(far)) == curve.at(int(far))
    assert VerifyCurve(short=(1.0, 1.2), long=(1.0, 1.1)).at(4000) == (1.0, 1.2)  # never below the short curve


def test_a_long_context_shortens_the_draft():
    """The same acceptance after a short and after a long context: extra rows cost more after a long one."""
    policy = AdaptiveLength(VerifyCurve(short=FLAT, long=STEEP), {}, lambda: 0.0)
    assert policy.next(None, 64) == policy.most
    assert policy.next(None, 512) == 1
    assert 1 <= policy.next(None, 120) <= policy.most


def test_the_policy_keeps_each_sources_acceptance_and_cost_apart():
    """Lookup first: copies (free, mostly kept) get long drafts while the model's guesses (costly, mostly
    rejected) get short ones in the same request; a source never seen starts from the prior."""
    curve = VerifyCurve.flat(1.0 + 0.02 * n for n in range(9))  # nearly flat up to 9 tokens
    policy = AdaptiveLength(curve, {"lookup": 0.0}, lambda: 0.3)
    fresh = AdaptiveLength(curve, {"lookup": 0.0}, lambda: 0.3)
    assert policy.next("lookup") > policy.next(None)  # the same prior, but a copy costs nothing
    for _ in range(8):
        policy.observe(policy.next("lookup"), policy.next("lookup"), "lookup")
        policy.observe(policy.next(None), 0, None)
    # a guess never kept does not pay for 0.3 of a pass: the model rests (plain passes) while copies run long
    assert policy.next("lookup") == policy.most and policy.next(None) == 0
    assert policy.alpha("lookup") > 0.9 > 0.3 > policy.alpha(None)
    assert policy.alpha("other") == fresh.alpha(None) == 0.6


def machine_shaped_curve() -> VerifyCurve:
    """gamma auto's verify curve at this machine's shape, T(n) / T(1) = 1 + 0.08 (n - 1), in place of one measured
    on a tiny model."""
    return VerifyCurve.flat(1 + 0.08 * n for n in range(AUTO_GAMMA_MAX + 1))


def test_lookup_first_names_the_source_of_its_next_proposal(tiny_models):
    """next_source says, from the context alone, whether the coming proposal is a copy: it agrees with the
    labels of what propose returns, and greedy output with gamma auto per source equals plain decoding."""
    target = tiny_models["target"]
    drafter = LookupFirstDrafter(ModelDrafter(tiny_models["draft"], target), max_ngram=3, min_ngram=2)
    ar = Engine(target)
    params = SamplingParams(max_new_tokens=40)
    for prompt in ["abc abc ab", "j. ihg"]:
        ids = ar.encode(prompt, chat=False)
        drafter.begin(ids)
        source = drafter.next_source(ids)
        labels = drafter.propose(ids, 4, params, None).labels
        assert set(labels) == ({LOOKUP_LABEL} if source == LOOKUP_LABEL else {drafter.inner.name}), prompt
    assert drafter.next_source(ar.encode("abc abc ab", chat=False)) == LOOKUP_LABEL
    assert drafter.next_source(ar.encode("j. ihg", chat=False)) is None
    # a curve measured on a tiny model is noisy: its T(2) can make every draft lose
    engine = Engine(target, drafter, SpecConfig("draft", None), curve=machine_shaped_curve())
    assert engine.source_costs == {LOOKUP_LABEL: 0.0} and engine.draft_cost() > 0
    # the tiny draft weighs nearly what the tiny target does, and would rarely pay for its steps: priced as a real
    # draft is (the 0.5B reads about 0.3 of the 1.5B), so that both sources draft
    drafter.inner.draft_bytes = 0.3 * engine.target_bytes
    sources, step_sources = set(), set()
    for prompt in ["abc ab", "dead beef cafe. dead be", "j. ihg"]:
        ids = ar.encode(prompt, chat=False)
        got = engine.generate(ids, params)
        assert got.token_ids == ar.generate(ids, params).token_ids, prompt
        sources |= set(got.stats.drafter["drafted_by"])
        assert got.stats.drafter["lookup_first"] == drafter.min_ngram
        # the per-source step tallies account for every accepted token, and first steps for every drafting pass
        steps = got.stats.steps_by_source
        assert sum(sum(s["kept"]) for s in steps.values()) == got.stats.accepted
        assert sum(s["reached"][0] for s in steps.values()) == sum(got.stats.drafted_per_position[:1])
        assert steps.get(LOOKUP_LABEL, {}).get("kept", [0])[0] <= got.stats.drafter["accepted_by"].get(LOOKUP_LABEL, 0)
        step_sources |= set(steps)
    assert sources == {LOOKUP_LABEL, drafter.inner.name}
    assert step_sources == {LOOKUP_LABEL, DRAFTER_SOURCE}


def test_steps_by_source_counts_reached_and_kept_steps():
    stats = SpecStats()
    stats.record_steps("lookup", 5, 2)  # kept steps 1-2, rejected step 3: steps 4-5 never examined
    stats.record_steps("lookup", 2, 2)  # kept both
    stats.record_steps(DRAFTER_SOURCE, 3, 0)  # rejected step 1
    assert stats.steps_by_source == {"lookup": {"reached": [2, 2, 1], "kept": [2, 2, 0]},
                                     DRAFTER_SOURCE: {"reached": [1], "kept": [0]}}
    assert SpecStats().to_dict()["steps_by_source"] == {}


def test_gamma_auto_is_a_chain_setting():
    assert SpecConfig("prompt-lookup", None).adaptive_gamma and SpecConfig("draft", None).draft_len == AUTO_GAMMA_MAX
    assert not SpecConfig("draft", 3).adaptive_gamma and SpecConfig("draft", 3).draft_len == 3
    tree = SpecConfig("draft-tree", None, tree_depth=3)
    assert not tree.adaptive_gamma and tree.draft_len == 3  # a tree's depth plays gamma's part
    assert not SpecConfig("ar", None).adaptive_gamma and SpecConfig("ar", None).draft_len == 0


def test_an_engine_measures_nothing_and_gamma_auto_asks_for_the_curve(tiny_models, monkeypatch):
    """Measuring the verify curve is a step of its own (verify_curve, which load_engine takes): constructing an
    Engine times nothing and writes nothing; gamma auto without a curve is refused with what to do."""
    from specdraft import api, load_engine
    from specdraft.config import ModelConfig
    from specdraft.models import verify_curve as vc

    target, drafter = tiny_models["target"], PromptLookupDrafter(3, 1)
    monkeypatch.setattr(vc, "measure", lambda *a: pytest.fail("an Engine measured the verify curve"))
    with pytest.raises(SpecdraftError, match="pass curve=verify_curve"):
        Engine(target, drafter, SpecConfig("prompt-lookup", None))
    assert Engine(target, drafter, SpecConfig("prompt-lookup", 3)).curve is None
    assert Engine(target, drafter, SpecConfig("prompt-lookup", None), curve=machine_shaped_curve()).curve is not None
    with pytest.raises(SpecdraftError, match="measure it for 9"):
        Engine(target, drafter, SpecConfig("prompt-lookup", None), curve=VerifyCurve.flat([1.0, 1.1, 1.2]))
    measured = []
    monkeypatch.setattr(api, "verify_curve", lambda model, n: measured.append(n) or machine_shaped_curve())
    engine = load_engine(ModelConfig(target="unused", draft=None), SpecConfig("prompt-lookup"), progress=False,
                         target=target)
    assert measured == [AUTO_GAMMA_MAX + 1] and engine.curve == machine_shaped_curve()


def test_the_curve_is_measured_once_and_kept_per_machine_setting(tiny_models, monkeypatch):
    from specdraft.models import verify_curve as vc

    target = tiny_models["target"]
    curve = vc.verify_curve(target, 5)
    # the tiny model has 512 positions: the long context leaves room for the timed passes
    assert (curve.short_context, curve.long_context) == (vc.PREFIX_TOKENS, 512 - 5 - 8)
    for relative in (curve.short, curve.long):
        assert len(relative) == 5 and relative[0] == 1.0 and list(relative) == sorted(relative)
    monkeypatch.setattr(vc, "measure", lambda *a: pytest.fail("measured again instead of reading the cache"))
    assert vc.verify_curve(target, 5) == curve
    measured = []
    ones = vc.VerifyCurve((1.0,) * 5, (1.0,) * 5, curve.short_context, curve.long_context)
    monkeypatch.setattr(vc, "measure", lambda t, n, prefix: measured.append((n, prefix)) or (1.0,) * n)
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)  # another thread count is another machine setting
    try:
        assert vc.verify_curve(target, 5) == ones
        assert measured == [(5, curve.short_context), (5, curve.long_context)]
    finally:
        torch.set_num_threads(previous)
    path = next(p for p in vc.curves_root().glob("*.json")
                if json.loads(p.read_text())["relative"] == list(curve.short))
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in stored.items() if k not in ("contexts", "relative_long")}))
    assert vc.verify_curve(target, 5) == ones and len(measured) == 4  # a file without the long curve: measured
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "estimator": "best of 3"}))  # another estimator: measured again
    assert vc.verify_curve(target, 5) == ones and len(measured) == 6
    measured[4:] = []
    path.write_text("{not json")  # a damaged file is measured again, not an error
    assert vc.verify_curve(target, 5) == ones and len(measured) == 6
    blocked = vc.curves_root() / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECDRAFT_VERIFY_CURVES", str(blocked / "curves"))  # cannot be created: still a curve
    assert vc.verify_curve(target, 5) == ones and len(measured) == 8


def test_a_draft_models_byte_price_is_measured_once_and_prices_its_tokens(tiny_models, monkeypatch):
    """A draft model's step costs more per byte than the target's (its layers' fixed work): gamma auto prices its
    token by its bytes times a timed price per byte (verify_curve.draft_price, cached like the curve); a free or
    byte-priced drafter is not timed; load_engine hands the price to the engine."""
    from specdraft import api, load_engine
    from specdraft.config import ModelConfig
    from specdraft.models import verify_curve as vc

    target, draft = tiny_models["target"], tiny_models["draft"]
    drafter = ModelDrafter(draft, target)
    assert drafter.timed_price and LookupFirstDrafter(drafter, 4, 2).timed_price
    price = vc.draft_price(target, drafter)
    assert 0 < price < float("inf")
    monkeypatch.setattr(drafter, "propose", lambda *a: pytest.fail("timed again instead of reading the cache"))
    assert vc.draft_price(target, drafter) == price
    lookup = PromptLookupDrafter(3, 1)
    monkeypatch.setattr(lookup, "propose", lambda *a: pytest.fail("a drafter priced by bytes was timed"))
    assert vc.draft_price(target, lookup) == 1.0
    engine = Engine(target, drafter, SpecConfig("draft", None), curve=machine_shaped_curve(), draft_price=2.5)
    assert engine.draft_cost() == pytest.approx(2.5 * drafter.draft_bytes / target.weight_bytes)
    monkeypatch.setattr(api, "verify_curve", lambda model, n: machine_shaped_curve())
    monkeypatch.setattr(api, "draft_price", lambda model, built: 3.0)
    engine = load_engine(ModelConfig(target="unused", draft="unused"), SpecConfig("draft"), progress=False,
                         target=target, draft=draft)
    assert engine.draft_price == 3.0
    assert load_engine(ModelConfig(target="unused", draft="unused"), SpecConfig("draft", 3), progress=False,
                       target=target, draft=draft).draft_price == 1.0  # a fixed gamma prices nothing


def test_the_draft_cost_is_read_before_every_pass():
    """A drafter's price may follow the request (the sorted draft's exits): the policy reads it at every pass."""
    price = [0.0]
    policy = AdaptiveLength(VerifyCurve.flat(1.0 + 0.02 * n for n in range(9)), {"lookup": 0.0}, lambda: price[0])
    free = policy.next()
    price[0] = 0.5
    assert policy.next() < free
    assert policy.next("lookup") == free  # a source with its own cost keeps it (same prior acceptance)


def test_the_server_batch_grows_while_a_doubled_batch_pays():
    from specdraft.models.verify_curve import BATCH_SIZES, max_batch_that_pays
    from specdraft.server.config import MAX_BATCH_LIMIT

    assert BATCH_SIZES == (1, 2, 4, 8, 16, 32, 64) and max(BATCH_SIZES) == MAX_BATCH_LIMIT
    # the Zen 3's passes of 1..16 sequences (docs/server.md, 2026-12-03), then compute-bound: tokens/s 1, 1.87,
    # 3.10, 3.56, 3.76 (5.6 % more), 3.81 (1.3 % more): 16
    zen3 = (1.0, 1.07, 1.29, 2.25, 4.25, 8.4, 16.8)
    assert max_batch_that_pays(zen3) == 16
    assert max_batch_that_pays(zen3, min_gain=1.10) == 8  # negative control: a stricter rule stops sooner
    assert max_batch_that_pays(zen3, min_gain=0.99) == 64
    assert max_batch_that_pays(tuple(float(n) for n in BATCH_SIZES)) == 1  # compute-bound from the start
    assert max_batch_that_pays((1.0,) * 7) == 64  # bound by the weights' bytes all the way
    # it stops at the first doubling that does not pay, even if a later one would (a noisy dip is not chased)
    assert max_batch_that_pays((1.0, 1.1, 4.0, 4.1, 4.2, 4.3, 4.4)) == 2
    with pytest.raises(ValueError, match="one cost per batch size"):
        max_batch_that_pays((1.0, 1.2))


def test_the_batch_curve_is_measured_once_per_machine_setting(tiny_models, monkeypatch, tmp_path):
    """What passes of 1..64 sequences cost (`batch_curve`, the server's auto max batch): measured on the native
    backend and cached; the transformers backend shares no passes, so it has none."""
    from specdraft.models import verify_curve as vc

    target = tiny_models["target"]
    if target.native is None:
        assert vc.batch_curve(target) is None
        return
    monkeypatch.setenv("SPECDRAFT_VERIFY_CURVES", str(tmp_path))  # not the curve another test measured already
    timed = []
    real = vc.time_batches
    monkeypatch.setattr(vc, "time_batches", lambda *a: timed.append(a[1]) or real(*a))
    relative = vc.batch_curve(target)
    assert len(relative) == len(vc.BATCH_SIZES) and relative[0] == 1.0 and list(relative) == sorted(relative)
    assert timed == [vc.BATCH_SIZES]
    assert vc.batch_curve(target) == relative and len(timed) == 1  # read from the cache
    path = next((vc.curves_root() / "batch-curves").glob("*.json"))
    path.write_text("{not json")  # a damaged file is measured again, not an error
    assert len(vc.batch_curve(target)) == len(vc.BATCH_SIZES) and len(timed) == 2


def test_the_curve_is_the_median_of_the_rounds_ratios():
    from specdraft.models.verify_curve import curve_from_rounds

    steady = [0.100, 0.105, 0.106, 0.124, 0.125]  # T(n) in seconds, n = 1..5
    rounds = [[t * scale for t in steady] for scale in (1.0, 1.02, 0.99, 1.01, 1.0)]  # drift: the ratios hold
    expected = tuple(t / steady[0] for t in steady)
    assert curve_from_rounds(rounds) == pytest.approx(expected)
    # one pass that met interference, in one round: a slow T(1) (all its ratios fall), a slow T(4), a fast T(5)
    noisy = [list(r) for r in rounds]
    noisy[1][0] *= 1.3
    noisy[2][3] *= 1.4
    noisy[3][4] *= 0.8
    assert curve_from_rounds(noisy) == pytest.approx(expected, rel=0.02)
    # negative control: the previous estimator (the fastest pass per length) is moved by the same three passes
    fastest = [min(r[n] for r in noisy) for n in range(5)]
    assert max(abs(f / fastest[0] - e) for f, e in zip(fastest, expected)) > 0.05
    # a dip is noise: the curve never falls with n
    assert curve_from_rounds([[0.1, 0.12, 0.11]]) == pytest.approx((1.0, 1.2, 1.2))
    with pytest.raises(ValueError):
        curve_from_rounds([])


@pytest.mark.parametrize("method", ["prompt-lookup", "draft"])
def test_greedy_with_gamma_auto_equals_autoregressive_and_varies_its_length(tiny_models, method):
    # the lengths chosen must follow acceptance, not the timing noise of a tiny model's passes on a loaded machine
    # (CI failed on that once)
    target = tiny_models["target"]
    drafter = (PromptLookupDrafter(3, 1) if method == "prompt-lookup"
               else ModelDrafter(tiny_models["draft"], target))
    engine = Engine(target, drafter, SpecConfig(method, None, lookup_first=0), curve=machine_shaped_curve())
    assert engine.curve is not None and len(engine.curve.short) == len(engine.curve.long) == AUTO_GAMMA_MAX + 1
    ar = Engine(target)
    params = SamplingParams(max_new_tokens=40)
    lengths = set()
    for prompt in ["abc ab", "dead beef cafe. dead be", "j. ihg"]:
        ids = ar.encode(prompt, chat=False)
        got = engine.generate(ids, params)
        assert got.token_ids == ar.generate(ids, params).token_ids, prompt
        stats = got.stats
        assert stats.gamma_auto and stats.gamma == AUTO_GAMMA_MAX
        per_position = stats.drafted_per_position + [0]
        lengths |= {k for k in range(1, len(per_position)) if per_position[k - 1] > per_position[k]}
    if method == "prompt-lookup":  # copies of the repeating prompts are often right: lengths follow acceptance
        assert len(lengths) >= 2


class Alternating:
    """A draft-length policy stand-in: 0, 3, 0, 3, ... tokens a pass."""

    most = 3

    def __init__(self):
        self.passes = 0

    def next(self, source=None, context_tokens=0, load=None, reads=1):
        self.passes += 1
        return 0 if self.passes % 2 else 3

    def token_cost(self, source=None):
        return 0.0

    def observe(self, drafted, accepted, source=None):
        pass


def test_passes_without_a_draft_leave_the_model_drafter_in_step(tiny_models, monkeypatch):
    """After a k = 0 pass the draft model has not seen the newest tokens: its next proposal feeds them all at
    once. Greedy output must stay the plain decoding's, and the drafting passes must still be accepted."""
    target = tiny_models["target"]
    engine = Engine(target, ModelDrafter(tiny_models["draft"], target), SpecConfig("draft", 3, lookup_first=0))
    monkeypatch.setattr(engine, "new_draft_length", lambda drafter=None: Alternating())
    params = SamplingParams(max_new_tokens=30)
    for prompt in ["abc ab", "dead beef cafe. dead be"]:
        ids = Engine(target).encode(prompt, chat=False)
        got = engine.generate(ids, params)
        assert got.token_ids == Engine(target).generate(ids, params).token_ids, prompt
        assert got.stats.drafted > 0 and got.stats.target_passes > got.stats.drafted_per_position[0]
    # what a greedy draft proposes after skipped passes equals what a drafter that never skipped proposes
    ids = Engine(target).encode("dead beef cafe. dead be", chat=False)
    longer = ids + Engine(target).generate(ids, SamplingParams(max_new_tokens=6)).token_ids
    skipping, steady = (ModelDrafter(tiny_models["draft"], target) for _ in range(2))
    skipping.begin(ids)
    steady.begin(ids)
    assert skipping.propose(ids, 0, params, None).k == 0
    steady.propose(ids, 2, params, None)
    steady.on_accept(ids + longer[len(ids): len(ids) + 2])
    for n in (4, 6):
        skipping.on_accept(longer[:len(ids) + n])  # a plain pass's token, never fed to the skipping draft
    assert skipping.propose(longer, 3, params, None).token_ids.tolist() == \
        steady.propose(longer, 3, params, None).token_ids.tolist()


def test_gamma_auto_keeps_the_target_distribution_and_the_negative_control_fails(tmp_path):
    """The statistical suite's test with each pass choosing its length; always-accept must still fail it."""
    from test_acceptance import always_accept
    from test_exactness import N_SAMPLES, P_THRESHOLD, SETTINGS, engine_chi_square_pvalue
    from tiny import build_model

    # the statistical suite's models (test_exactness.small_vocab), native backend
    target = load_model(str(build_model(tmp_path / "t", seed=11, chars="abcde", init_range=0.5)), "float32")
    draft = load_model(str(build_model(tmp_path / "d", seed=12, chars="abcde", init_range=0.5, layers=1)), "float32")
    # a budget past the two counted tokens, so that the second token's pass drafts a length chosen from the
    # first pass's outcome (3 from the prior on this curve, 1 or more after it)
    params = SamplingParams(**{**SETTINGS["T=1"].__dict__, "max_new_tokens": 8})

    def engine(price: float = 0.0, **rule):
        built = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", None, lookup_first=0), **rule,
                       curve=VerifyCurve.flat(1.0 + 0.1 * n for n in range(9)))
        # priced as free, so that the lengths follow acceptance alone; or at `price` of a target pass
        built.drafter.draft_bytes = price * built.target_bytes
        return built

    assert engine().new_draft_length().next() == 3
    assert engine_chi_square_pvalue(engine(), target, params, N_SAMPLES) > P_THRESHOLD
    assert engine_chi_square_pvalue(engine(sampling_rule=always_accept), target, params, N_SAMPLES) < P_THRESHOLD
    # priced at 0.45 of a pass: one token from the prior, then none after a rejection (k = 0 chosen from the past)
    policy = engine(0.45).new_draft_length()
    assert policy.next() == 1
    policy.observe(1, 0)
    assert policy.next() == 0
    assert engine_chi_square_pvalue(engine(0.45), target, params, N_SAMPLES) > P_THRESHOLD
    assert engine_chi_square_pvalue(engine(0.45, sampling_rule=always_accept), target, params,
                                    N_SAMPLES) < P_THRESHOLD


def test_gamma_parses_auto_and_refuses_nonsense():
    assert parse_gamma("auto") is None and parse_gamma("3") == 3
    with pytest.raises(SpecdraftError, match="gamma must be between"):
        SpecConfig("draft", parse_gamma("0"))
    for bad in ("-1", "often"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_gamma(bad)
    assert parse_method("prompt-lookup[gamma=auto]") == ("prompt-lookup", {"gamma": None})
    plan = plan_variants(BenchSettings(methods=("ar", "prompt-lookup[gamma=auto]"), draft="d"))
    assert [spec.adaptive_gamma for _, _, _, spec in plan] == [False, True]
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    for bad in ("often", "2,-1", "auto,2,auto"):
        with pytest.raises(SpecdraftError, match="--gamma"):
            settings_from_args(parser.parse_args(["--gamma", bad]))


def test_gamma_auto_is_the_default_and_transformers_keeps_its_own_length():
    """gamma auto is the default of SpecConfig and of a bench run; transformers' prompt lookup, which has no
    per-pass choice, then drafts its own default length; a sweep labels the auto column."""
    assert SpecConfig().gamma is None and SpecConfig("draft").adaptive_gamma
    assert not SpecConfig("eagle-tree").adaptive_gamma and not SpecConfig("ar").adaptive_gamma
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert settings_from_args(parser.parse_args([])).gammas == (None,) == BenchSettings().gammas
    plan = plan_variants(BenchSettings(methods=("ar", "prompt-lookup", "hf-prompt-lookup", "hf-assisted",
                                                "hf-prompt-lookup[gamma=3]", "eagle-tree"), draft="d"))
    assert [(label, gamma) for label, _, gamma, _ in plan] == [
        ("ar", None), ("prompt-lookup", None), ("hf-prompt-lookup", HF_AUTO_GAMMA), ("hf-assisted", None),
        ("hf-prompt-lookup[gamma=3]", 3), ("eagle-tree", None)]
    assert plan[1][3].adaptive_gamma and plan[2][3].gamma == HF_AUTO_GAMMA
    swept = plan_variants(settings_from_args(parser.parse_args(["--gamma", "auto,4", "--methods",
                                                                 "ar,prompt-lookup,draft[gamma=2]"])))
    assert [(label, gamma) for label, _, gamma, _ in swept] == [
        ("ar", None), ("prompt-lookup-gauto", None), ("prompt-lookup-g4", 4), ("draft[gamma=2]", 2)]


def test_report_predicts_tau_for_auto_columns_from_the_lengths_drafted():
    """An auto column's predicted tau averages the chain formula over the lengths its passes drafted, pooled
    over turns; it shows as "auto". A fixed column keeps the formula at its gamma."""
    stats = {"gamma_auto": True}
    # turn 1: 3 passes of lengths 2, 2, 1; turn 2: 1 pass of length 3
    auto = [dict(gamma=None, target_passes=3, drafted_per_position=[3, 2], stats=stats),
            dict(gamma=None, target_passes=1, drafted_per_position=[1, 1, 1], stats=stats)]
    assert gamma_label(auto) == "auto" and gamma_label([dict(gamma=3, stats={})]) == 3
    alpha = 0.6
    want = (2 * expected_tokens(alpha, 2) + expected_tokens(alpha, 1) + expected_tokens(alpha, 3)) / 4
    assert report_predicted_tau(alpha, "auto", auto) == pytest.approx(want)
    assert report_predicted_tau(alpha, 3, auto) == pytest.approx(expected_tokens(alpha, 3))
    assert report_predicted_tau(alpha, None, auto) is None
    # the same formula as a request's own statistics
    one = SpecStats(method="draft", gamma=8, gamma_auto=True)
    for k, kept in ((2, 1), (2, 2), (1, 0)):
        one.record(k, kept)
    assert one.predicted_tau == pytest.approx(report_predicted_tau(one.alpha, "auto", [dict(
        target_passes=one.target_passes, drafted_per_position=one.drafted_per_position)]))
