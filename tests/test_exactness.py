"""Statistical exactness of the whole loop on tiny models whose distributions we can enumerate.

The target and draft are tiny random models over a 7-token vocabulary (<unk>, <eos>, a..e). For the first two
emitted tokens we compute the target's exact joint distribution P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1)
(an <eos> first ends the sequence: outcome (eos,)). Then the speculative engine (γ = 3, 3 new tokens, so the
first pass drafts 2 tokens and both of the counted tokens can come from accepted, recovered and bonus positions)
runs N times with different seeds, and a chi-square test compares the counts with N · P.

Sample size N = 1500 per setting; pass if p-value > 1e-3 (the exact engine fails by chance with probability
1e-3 per setting). The negative controls (always accept; recover from p instead of norm((p - q)+)) run the same
test on the same models and must give p < 1e-3: the draft is made to differ from the target by a total
variation distance asserted to be > 0.2, so their bias is large against the test's resolution at this N.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdraft import Engine, SamplingParams, SpecConfig, load_model
from specdraft.drafters import ModelDrafter
from specdraft.sampling import processed_probs
from test_acceptance import always_accept, resample_from_target
from test_draft_length import Alternating

N_SAMPLES, P_THRESHOLD = 1500, 1e-3
PROMPT = [2, 3, 4]  # "abc"
SETTINGS = {
    "T=1": SamplingParams(temperature=1.0, max_new_tokens=3),
    "T=0.7,top-k=3": SamplingParams(temperature=0.7, top_k=3, max_new_tokens=3),
    "T=1.3,top-p=0.8": SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=3),
}


@pytest.fixture(scope="module", params=["native", "transformers", "gguf"])
def small_vocab(tmp_path_factory, request):
    """Target and draft on each backend, and natively from GGUF files in Q8_0 blocks (the quantized kernels): the
    statistical tests (and their negative controls) run on all three."""
    from tiny import build_model
    from tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("small_vocab")
    models = {"t": build_model(root / "t", seed=11, chars="abcde", init_range=0.5),
              "d": build_model(root / "d", seed=12, chars="abcde", init_range=0.5, layers=1)}
    if request.param == "gguf":
        return tuple(load_model(str(write_gguf(path, root / "cache", name, "Q8_0")), "gguf")
                     for name, path in models.items())
    return tuple(load_model(str(path), "float32", backend=request.param) for path in models.values())


def exact_joint(target, params: SamplingParams) -> dict[tuple, float]:
    eos = target.eos_token_ids
    with torch.inference_mode():
        first = processed_probs(target.new_state().forward(PROMPT, 1), params)[0]  # [V]
        joint: dict[tuple, float] = {}
        for t1 in range(first.shape[0]):
            if first[t1] == 0:
                continue
            if t1 in eos:
                joint[(t1,)] = float(first[t1])
                continue
            second = processed_probs(target.new_state().forward(PROMPT + [t1], 1), params)[0]
            for t2 in range(second.shape[0]):
                if second[t2] > 0:
                    joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def outcome(result, eos: set[int]) -> tuple:
    tokens = result.token_ids[:2]
    if len(tokens) < 2 and result.stats.finish_reason == "stop":
        tokens = tokens + [next(iter(eos))]
    return tuple(tokens)


def engine_pvalue(target, draft, params, rule=None, min_confidence: float = 0.0, drafter=None,
                  spec: SpecConfig | None = None, batch: int = 1) -> float:
    """p-value of the chi-square test; the drafter defaults to the independent draft model at gamma 3 (one per
    request in flight)."""
    drafter = drafter or ModelDrafter(draft, target, min_confidence)
    engine = Engine(target, drafter, spec or SpecConfig("draft", 3), **({"sampling_rule": rule} if rule else {}),
                    new_drafter=lambda: ModelDrafter(draft, target, min_confidence))
    return engine_chi_square_pvalue(engine, target, params, N_SAMPLES, batch)


def engine_chi_square_pvalue(engine: Engine, target, params, n: int, batch: int = 1) -> float:
    """Chi-square p-value of the first two tokens of `n` generations from PROMPT (seeds 0..n-1) against the
    target's exact joint distribution; 0 when a sequence the target gives probability 0 was emitted. batch > 1:
    the generations run `batch` at a time as concurrent requests (`generate_many`: one target pass for all)."""
    expected = exact_joint(target, params)
    counts = dict.fromkeys(expected, 0)
    results = []
    for first in range(0, n, batch):
        seeded = [SamplingParams(**{**params.__dict__, "seed": seed}) for seed in range(first, min(n, first + batch))]
        results += (engine.generate_many([PROMPT] * len(seeded), seeded) if batch > 1
                    else [engine.generate(PROMPT, seeded[0])])
    for result in results:
        key = outcome(result, target.eos_token_ids)
        counts[key] = counts.get(key, 0) + 1  # a key outside the support fails the test below
    observed = np.array([counts[k] for k in counts], dtype=float)
    expected_counts = np.array([expected.get(k, 0.0) * n for k in counts])
    if (expected_counts[observed > 0] == 0).any():
        return 0.0  # emitted a sequence the target gives probability 0
    # pool the cells with expected count < 5 so the chi-square approximation holds
    small = expected_counts < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected_counts = np.append(expected_counts[~small], expected_counts[small].sum())
    keep = expected_counts > 0
    observed, expected_counts = observed[keep], expected_counts[keep]
    expected_counts *= observed.sum() / expected_counts.sum()  # float32 probabilities sum to 1 only roughly
    return float(chisquare(observed, expected_counts).pvalue)


def test_draft_really_differs_from_target(small_vocab):
    target, draft = small_vocab
    params = SETTINGS["T=1"]
    with torch.inference_mode():
        p = processed_probs(target.new_state().forward(PROMPT, 1), params)[0]
        q = processed_probs(draft.new_state().forward(PROMPT, 1), params)[0]
    assert 0.5 * (p - q).abs().sum() > 0.2


@pytest.mark.parametrize("name", list(SETTINGS))
def test_emitted_tokens_follow_the_target_distribution(small_vocab, name):
    target, draft = small_vocab
    pvalue = engine_pvalue(target, draft, SETTINGS[name])
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_confidence_stopped_drafts_stay_exact(small_vocab):
    target, draft = small_vocab
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], min_confidence=0.35)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_a_draft_reading_part_of_the_prompt_stays_exact(small_vocab):
    """draft_context 1: the draft model sees the prompt's last token only, so its q differs from the full
    prompt's (checked) and the emitted tokens must still follow the target."""
    target, draft = small_vocab
    params = SETTINGS["T=1"]
    windowed = ModelDrafter(draft, target, context_tokens=1)
    with torch.inference_mode():
        windowed.begin(PROMPT)
        q_window = processed_probs(windowed.state.forward(PROMPT[-1:], 1), params)[0]
        q_full = processed_probs(draft.new_state().forward(PROMPT, 1), params)[0]
    assert 0.5 * (q_window - q_full).abs().sum() > 0.05
    engine = Engine(target, ModelDrafter(draft, target, context_tokens=1), SpecConfig("draft", 3, draft_context=1))
    pvalue = engine_chi_square_pvalue(engine, target, params, N_SAMPLES)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_a_draft_that_starts_over_after_a_rest_stays_exact(small_vocab, monkeypatch):
    """draft_context 1 and a plain first pass: at its first proposal the draft finds 2 tokens unseen past its window
    and starts over on the last one (`window_feed`), then drafts the second token, which must still follow the
    target (checked: the window moved)."""
    target, draft = small_vocab
    params = SamplingParams(temperature=1.0, max_new_tokens=4)  # room to draft in the second pass
    drafter = ModelDrafter(draft, target, context_tokens=1)
    engine = Engine(target, drafter, SpecConfig("draft", 3, draft_context=1))
    monkeypatch.setattr(engine, "new_draft_length", lambda drafter=None: Alternating())
    restarted = 0
    with torch.inference_mode():
        for seed in range(20):
            if engine.generate(PROMPT, SamplingParams(**{**params.__dict__, "seed": seed})).stats.drafted:
                restarted += drafter.context_start >= len(PROMPT)  # begun at len(PROMPT) - 1, then started over
    assert restarted > 0
    pvalue = engine_chi_square_pvalue(engine, target, params, N_SAMPLES)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


@pytest.mark.parametrize("rule", [always_accept, resample_from_target], ids=["always-accept", "resample-from-p"])
def test_negative_control_wrong_rule_fails_the_same_test(small_vocab, rule):
    target, draft = small_vocab
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], rule)
    assert pvalue < P_THRESHOLD, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


CONCURRENT = 8  # requests decoded together in the batched tests


def test_concurrent_requests_follow_the_target_distribution(small_vocab):
    """Eight requests at a time, each with its own seed, drafter and generator, every target pass scoring all of
    them: still the target's distribution."""
    target, draft = small_vocab
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], batch=CONCURRENT)
    assert pvalue > P_THRESHOLD, f"p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_negative_control_wrong_rule_fails_with_concurrent_requests(small_vocab):
    target, draft = small_vocab
    pvalue = engine_pvalue(target, draft, SETTINGS["T=1"], always_accept, batch=CONCURRENT)
    assert pvalue < P_THRESHOLD, f"the wrong rule passed: p-value {pvalue:.2e} at N={N_SAMPLES}"


def test_joint_distribution_sums_to_one(small_vocab):
    target, _ = small_vocab
    for params in SETTINGS.values():
        assert abs(sum(exact_joint(target, params).values()) - 1.0) < 1e-4
