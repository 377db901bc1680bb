"""Replay gamma auto over recorded greedy answers: what each pass would draft, what the target would keep, and what
the passes would cost on this machine's measured costs, without running the target. A greedy answer does not
depend on the drafts (every lossless method emits the `ar` answer), so a bench run's `ar` records say what each
draft would have had accepted. Drafts: prompt lookup's copies from its n-gram index; a draft model's greedy chain
from the draft model itself, run as in a generation (its window of unseen tokens, its restarts after a rest), the
target's answer fed to it as the target would have kept it. Only the time is modelled: a pass over n tokens after c
cached ones costs the verify curve's T(n) / T(1) at c (as gamma auto reads it), a plain pass 1, a copy nothing
more, a draft model's forward over n tokens what it measures here (`feed_costs`: a catch-up after copies and plain
passes costs more than a step); prefill is left out. Timing noise does not enter the replay itself, so policies can
be compared on a few prompts (tune on data/bench/prompts-03-04.jsonl and -11-20; keep -05-10 for verdicts).

    specdraft bench --prompts data/bench/prompts-11-20.jsonl --methods ar --max-new-tokens 64 --out out/tune-ar
    python scripts/replay_gamma.py --records out/tune-ar/records.jsonl --prompts data/bench/prompts-11-20.jsonl

Prints, per method, policy and category, the predicted decode speedup over plain decoding (the plain passes' cost
over the policy's), tokens per pass and tokens drafted per emitted token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft import ModelConfig, SpecConfig, load_engine
from specdraft.bench.suite import load_prompts
from specdraft.config import SamplingParams
from specdraft.draft_length import AdaptiveLength, PassLoad, Tally, expected_tokens, pass_cost_at
from specdraft.drafters.lookup_first import LOOKUP_LABEL, LookupFirstDrafter
from specdraft.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.types import Draft


@dataclass
class Turn:
    category: str
    prompt_ids: list[int]
    answer: list[int]  # the ar answer, with the end-of-text token when it stopped (a pass emits it)


def read_turns(engine: Engine, prompts_path: str, records_path: str) -> list[Turn]:
    """Every ar turn of the run, its prompt rebuilt as the bench builds it (chat template over the history)."""
    records = {}
    for line in Path(records_path).read_text().splitlines():
        record = json.loads(line)
        if record["label"] == "ar":
            records[(record["question_id"], record["turn"])] = record
    found = []
    for prompt in load_prompts(prompts_path):
        messages = []
        for turn, user_text in enumerate(prompt["turns"]):
            record = records.get((prompt["question_id"], turn))
            if record is None:
                raise SystemExit(f"{records_path} has no ar record of {prompt['question_id']} turn {turn}")
            messages.append({"role": "user", "content": user_text})
            ids = engine.encode_messages(messages)
            if len(ids) != record["prompt_tokens"]:
                raise SystemExit(f"{prompt['question_id']} turn {turn}: {len(ids)} prompt tokens here, "
                                 f"{record['prompt_tokens']} in the record")
            answer = list(record["output_ids"])
            if record["finish_reason"] == "stop":
                answer.append(engine.target.tokenizer.eos_token_id)
            found.append(Turn(prompt["category"], ids, answer))
            messages.append({"role": "assistant", "content": record["text"]})
    return found


def feed_costs(engine: Engine, most: int = 24, rounds: int = 5) -> list[float]:
    """costs[n - 1]: a draft model's one-token proposal that first feeds n tokens (what it has not seen: a copy's
    tokens, a plain pass's), relative to a one-token target pass; alternated, the median of `rounds`. A proposal
    is one forward over its feed and one per further draft token, so costs[0] prices those."""
    drafter, target = engine.drafter.inner, engine.target
    ids = torch.randint(0, 30000, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    state = target.new_state(capacity=200)
    draft_s: dict[int, list[float]] = defaultdict(list)
    window, drafter.context_tokens = drafter.context_tokens, 0  # every feed in full, whatever the window
    target_s = []
    with torch.inference_mode():
        state.forward(ids[:99], 1)
        drafter.begin(ids[:100])
        for _ in range(rounds):
            for n in range(1, most + 1):
                behind = ids[:150 - n]
                drafter.propose(behind, 1, params, None)  # fed up to its last token
                drafter.on_accept(behind)
                started = time.perf_counter()
                drafter.propose(ids[:150], 1, params, None)
                draft_s[n].append(time.perf_counter() - started)
                drafter.on_accept(ids[:100])
                started = time.perf_counter()
                state.verify(ids[99], Draft.empty())
                target_s.append(time.perf_counter() - started)
                state.truncate(99)
    drafter.context_tokens = window
    step = statistics.median(target_s)
    return [statistics.median(draft_s[n]) / step for n in range(1, most + 1)]


@dataclass
class LagPriced(AdaptiveLength):
    """gamma auto that prices a draft model's catch-up: drafting at all first feeds `lag` tokens, costing the draft's
    token cost times T(lag) / T(1) (the target's curve as the draft's shape) instead of one token's."""

    def next(self, source=None, context_tokens=0, load=PassLoad(), lag: int = 1) -> int:
        curve = self.curve.at(context_tokens)
        cost = self.token_cost(source)
        extra = cost * (pass_cost_at(curve, lag) - 1.0)
        alpha = self.alpha(source)

        def tokens_per_time(k: int) -> float:
            spent = pass_cost_at(curve, load.tokens + 1 + k) + load.draft_cost + k * cost + (extra if k else 0.0)
            return (load.requests + expected_tokens(alpha, k)) / spent

        length = max(range(len(curve)), key=lambda k: (tokens_per_time(k), -k))
        if length == 0 and self.tallies.get(source, Tally()).examined < self.rest_evidence and not load.requests:
            length = 1
        (self.resting.add if length == 0 else self.resting.discard)(source)
        return length


class FedCounter:
    """Wraps a draft model state's `forward` to record how many tokens each call feeds."""

    def __init__(self, state):
        self.state, self.forward, self.calls = state, state.forward, []
        state.forward = self

    def __call__(self, new_ids, n_logits):
        self.calls.append(len(new_ids))
        return self.forward(new_ids, n_logits)

    def release(self):
        del self.state.forward


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)


def replay(turn: Turn, policy: AdaptiveLength, lookup: NgramIndex | None, model, max_new_tokens: int,
           feed: list[float] | None) -> tuple[float, int, int]:
    """(cost of the policy's passes in T(1)s, passes, tokens drafted) for one answer. lookup: prompt lookup's
    index (alone, or first in front of the draft model); model: the draft model's drafter (None: copies only),
    drafting where no copy exists, begun at its first proposal; feed: its forwards' costs by tokens fed."""
    answer, context = turn.answer, list(turn.prompt_ids)
    cost, passes, drafted_total, emitted, counter = 0.0, 0, 0, 0, None
    while emitted < len(answer):
        copy = []
        if lookup is not None:
            lookup.update(context)
            copy = lookup.continuation(1)
        source = LOOKUP_LABEL if copy and model is not None else None
        lag = (model.catch_up_tokens(len(turn.prompt_ids), len(context)) if counter is None
               else len(model.to_feed(context))) if model is not None and source is None else 1
        k = min(policy.next(source, len(context), lag=lag) if isinstance(policy, LagPriced)
                else policy.next(source, len(context)), max_new_tokens - emitted - 1)  # the engine's cap
        if k <= 0:
            draft = []
        elif copy or model is None:
            draft = lookup.continuation(k)
        else:  # the draft model's chain, as in a generation
            if counter is None:
                model.begin(turn.prompt_ids)
                counter = FedCounter(model.state)
            counter.calls.clear()
            with torch.inference_mode():
                draft = model.propose(context, k, GREEDY, None).token_ids.tolist()
            cost += sum(feed[min(n, len(feed)) - 1] for n in counter.calls)
        accepted = 0
        while (accepted < len(draft) and emitted + accepted < len(answer)
               and draft[accepted] == answer[emitted + accepted]):
            accepted += 1
        policy.observe(len(draft), accepted, source)
        cost += policy.curve.at(len(context))[len(draft)]
        if source is not None or model is None:
            cost += len(draft) * policy.token_cost(source)
        passes += 1
        drafted_total += len(draft)
        step = accepted + 1
        context.extend(answer[emitted:emitted + step])
        emitted += step
        if counter is not None:
            with torch.inference_mode():
                model.on_accept(context)
    if counter is not None:
        counter.release()
    return cost, passes, drafted_total


DRAFT_MODEL_ONLY = {"lag_priced", "lookup_first", "draft_context"}
VARIANTS = {  # gamma auto's settings tried against its defaults (AdaptiveLength's fields; lookup_first: the
    # least n-gram a copy continues in front of a draft model, 0: none)
    "auto": {},
    "price the catch-up": {"lag_priced": True},
    "lookup first 3": {"lookup_first": 3},
    "no lookup first": {"lookup_first": 0},
    "draft context 2": {"draft_context": 2},
    "draft context 8": {"draft_context": 8},
    "draft context 16": {"draft_context": 16},
    "draft context 32": {"draft_context": 32},
    "prior 0.4": {"prior_alpha": 0.4},
    "prior 0.8": {"prior_alpha": 0.8},
    "prior weight 1": {"prior_weight": 1.0},
    "prior weight 4": {"prior_weight": 4.0},
    "decay 0.5": {"decay": 0.5},
    "decay 0.9": {"decay": 0.9},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", required=True, help="a bench run's records.jsonl with `ar` turns")
    parser.add_argument("--prompts", required=True, help="the prompt file of that run")
    parser.add_argument("--methods", default="prompt-lookup,draft")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    parser.add_argument("--max-new-tokens", type=int, default=64, help="as the bench ran")
    parser.add_argument("--threads", type=int, default=2, help="as the bench ran (the measured costs are per count)")
    args = parser.parse_args()
    for method in args.methods.split(","):
        engine = load_engine(ModelConfig(threads=args.threads), SpecConfig(method), progress=False)
        drafter = engine.drafter
        copies_only = isinstance(drafter, PromptLookupDrafter)
        if not (copies_only or isinstance(drafter, LookupFirstDrafter)):
            raise SystemExit(f"{method}: replays prompt lookup, or a model drafter with lookup first")
        turns = read_turns(engine, args.prompts, args.records)
        default_window = None if copies_only else drafter.inner.context_tokens
        feed = None if copies_only else feed_costs(engine)
        categories = list(dict.fromkeys(turn.category for turn in turns))
        print(f"\n{method}: a draft token costs {engine.draft_cost():.3f} T(1) as gamma auto prices it"
              + ("" if feed is None else "; measured, a proposal that feeds 1 / 2 / 4 / 8 / 16 tokens: "
                 + " / ".join(f"{feed[n - 1]:.2f}" for n in (1, 2, 4, 8, 16)))
              + f"; {len(turns)} turns\n")
        print("| policy | " + " | ".join(categories) + " | overall | tokens/pass | drafted/token |")
        print("|" + "---|" * (len(categories) + 4))
        for name in args.variants.split(","):
            if copies_only and DRAFT_MODEL_ONLY & VARIANTS[name].keys():
                continue  # a setting of the draft model's
            plain: dict[str, float] = defaultdict(float)
            spent: dict[str, float] = defaultdict(float)
            passes = drafted = tokens = 0
            for turn in turns:
                policy = engine.new_draft_length()
                settings = dict(VARIANTS[name])
                if settings.pop("lag_priced", False):
                    policy = LagPriced(policy.curve, policy.source_costs, policy.draft_cost)
                least = settings.pop("lookup_first", drafter.min_ngram)
                model = None if copies_only else drafter.inner
                if model is not None:
                    model.context_tokens = settings.pop("draft_context", default_window)
                for attribute, value in settings.items():
                    setattr(policy, attribute, value)
                lookup = NgramIndex(max(drafter.max_ngram, least), least) if least else None
                cost, n_passes, n_drafted = replay(turn, policy, lookup, model, args.max_new_tokens, feed)
                plain[turn.category] += len(turn.answer)
                spent[turn.category] += cost
                passes, drafted, tokens = passes + n_passes, drafted + n_drafted, tokens + len(turn.answer)
            overall = sum(plain.values()) / sum(spent.values())
            print(f"| {name} | " + " | ".join(f"{plain[c] / spent[c]:.2f}x" for c in categories)
                  + f" | {overall:.2f}x | {tokens / passes:.2f} | {drafted / tokens:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
