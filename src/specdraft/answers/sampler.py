"""Many answers to one prompt from one model: a greedy answer, then N sampled answers decoded together.

Every answer is an engine request (`Engine.generate`, `Engine.generate_many`): sampled answer i is exactly the
request `SamplingParams(temperature, top_p, top_k, seed=seeds[i])` would give alone (its own torch.Generator; the
native kernels are batch-invariant, so sharing a pass changes no bit). With the engine's prefix cache the prompt is
prefilled once: the greedy request stores its K/V, the sampled ones start from them; on the native backend the N
samples share each target pass (the weights are read once for all of them). An answer ends where its stop rule
first holds (checked as if after every token), at EOS, or at `max_new_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..config import SamplingParams
from ..engine import Engine, StopRule
from ..types import GenerationResult


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop rule) or "length"


@dataclass
class AnswerSet:
    """The greedy answer (if asked for), the sampled answers, and what they cost."""

    prompt_tokens: int
    greedy: Answer | None
    samples: list[Answer] = field(default_factory=list)
    time_prefill_s: float = 0.0  # the prompt's prefill (and the cheap restores of it for the other requests)
    time_greedy_s: float = 0.0
    time_samples_s: float = 0.0
    # target passes after the prefill: the greedy answer's, and the sampled answers' together (one per request and
    # pass; requests in one pass share its weight reads on the native backend)
    greedy_passes: int = 0
    sample_passes: int = 0


def one_line(text: str) -> bool:
    """Stop rule for one-line answers: a newline after some text."""
    return "\n" in text.lstrip()


def _answer(result: GenerationResult) -> Answer:
    return Answer(result.text, list(result.token_ids), result.stats.finish_reason)


def sample_answers(engine: Engine, prompt_ids: list[int], n: int, temperature: float, max_new_tokens: int,
                   seeds: list[int], stop_rule: StopRule | None = one_line, greedy: bool = True,
                   top_p: float = 1.0, top_k: int = 0) -> AnswerSet:
    """A greedy answer and `n` sampled answers (answer i seeded with seeds[i]) from the engine's target; give the
    engine a prefix cache (`Engine(..., prefix_cache=PrefixCache(...))`) to prefill the prompt once."""
    if len(seeds) < n:
        raise ValueError(f"need {n} seeds, got {len(seeds)}")
    out = AnswerSet(prompt_tokens=len(prompt_ids), greedy=None)
    if greedy:
        started = time.perf_counter()
        result = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens), stop_when=stop_rule)
        out.greedy = _answer(result)
        out.time_prefill_s += result.stats.time_prefill_s
        out.time_greedy_s = time.perf_counter() - started - result.stats.time_prefill_s
        out.greedy_passes = result.stats.target_passes
    if n > 0:
        started = time.perf_counter()
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                 seed=int(seed)) for seed in seeds[:n]]
        results = engine.generate_many([list(prompt_ids)] * n, params, stop_when=stop_rule)
        prefill = sum(r.stats.time_prefill_s for r in results)
        out.samples = [_answer(r) for r in results]
        out.time_prefill_s += prefill
        out.time_samples_s = time.perf_counter() - started - prefill
        out.sample_passes = sum(r.stats.target_passes for r in results)
    return out
