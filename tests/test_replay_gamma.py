"""scripts/replay_gamma.py: replaying gamma auto over a recorded greedy answer, the draft model proposing as it does
in a generation (its window, its restarts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from specdraft import Engine, SamplingParams
from specdraft.draft_length import AdaptiveLength, VerifyCurve
from specdraft.drafters import ModelDrafter

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_gamma.py"
spec = importlib.util.spec_from_file_location("replay_gamma", SCRIPT)
replay_gamma = importlib.util.module_from_spec(spec)
sys.modules["replay_gamma"] = replay_gamma  # its dataclasses look their module up
spec.loader.exec_module(replay_gamma)

CURVE = VerifyCurve.flat([1.0, 1.05, 1.1, 1.2, 1.3])
FEED = [0.3 + 0.05 * n for n in range(24)]  # a forward over n + 1 tokens, relative to one target pass


def policy(token_cost: float = 0.3) -> AdaptiveLength:
    return AdaptiveLength(CURVE, {}, lambda: token_cost)


def recording(length_policy: AdaptiveLength, lengths: list[int]) -> AdaptiveLength:
    """The policy, each pass's draft length appended to `lengths` as it is observed."""
    observe = length_policy.observe

    def observed(drafted: int, accepted: int, source=None) -> None:
        lengths.append(drafted)
        observe(drafted, accepted, source)

    length_policy.observe = observed
    return length_policy


@pytest.mark.parametrize("context_tokens", [0, 3])
def test_a_draft_model_replay_counts_its_forwards_and_kept_tokens(tiny_models, context_tokens, monkeypatch):
    """The target as its own draft: every guess is kept, so passes emit several tokens each; the cost is each pass's
    verify cost at its draft's length plus each draft forward's cost by the tokens it fed, and the drafter's state
    is handed back unwrapped."""
    target = tiny_models["target"]
    prompt = [2, 3, 4, 5, 6, 7, 8, 9, 10]
    answer = Engine(target).generate(prompt, SamplingParams(max_new_tokens=12, temperature=0)).token_ids
    turn = replay_gamma.Turn("code", prompt, answer)
    drafter = ModelDrafter(target, target, context_tokens=context_tokens)
    fed: list[int] = []  # every draft forward's token count, over the whole replay

    class Recording(replay_gamma.FedCounter):
        def __call__(self, new_ids, n_logits):
            fed.append(len(new_ids))
            return super().__call__(new_ids, n_logits)

    monkeypatch.setattr(replay_gamma, "FedCounter", Recording)
    lengths: list[int] = []
    cost, passes, drafted = replay_gamma.replay(turn, recording(policy(), lengths), None, drafter, 64, FEED)
    assert passes == len(lengths) < len(answer) and drafted == sum(lengths)
    assert cost == pytest.approx(sum(CURVE.short[k] for k in lengths) + sum(FEED[n - 1] for n in fed))
    assert max(fed) <= (context_tokens or len(prompt) + len(answer))  # a window bounds every read
    assert "forward" not in vars(drafter.state)  # the counter let go of the state


def test_copies_only_cost_the_verify_passes():
    """Prompt lookup alone, its copies free: the cost is each pass's verify cost at its draft's length."""
    from specdraft.drafters.prompt_lookup import NgramIndex

    prompt = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
    answer = [4, 5, 2, 3, 4, 5, 9]
    turn = replay_gamma.Turn("rag", prompt, answer)
    lengths: list[int] = []
    copies = recording(policy(token_cost=0.0), lengths)
    cost, passes, drafted = replay_gamma.replay(turn, copies, NgramIndex(3, 1), None, 64, None)
    assert passes == len(lengths) < len(answer) and drafted == sum(lengths) > 0
    assert cost == pytest.approx(sum(CURVE.short[k] for k in lengths))
