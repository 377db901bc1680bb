"""Many answers to one prompt from one model: one prefill, a greedy answer, then N sampled answers decoded as one
batch that shares the prompt's KV cache (rows are copies of the prefilled cache; a row leaves the batch when it
finishes).

Sampled row i draws every token with its own `torch.Generator` seeded with `seeds[i]`, through the same
`processed_probs` + `sample` calls as `Engine.generate` with `SamplingParams(seed=seeds[i])`, so each row is
that engine request (up to last-bit differences between a batched and a single-row matmul). The engine is the
reference; this is the fast path for answer-scale experiments (tests/test_answers.py compares them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import SamplingParams
from ..models.adapter import LoadedModel
from ..models.batched import BatchDecoder
from ..sampling import processed_probs, sample

# decoded text of one answer so far -> True when the answer is complete (e.g. a newline for one-line answers)
StopRule = Callable[[str], bool]


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
    time_prefill_s: float = 0.0
    time_greedy_s: float = 0.0
    time_samples_s: float = 0.0
    # forward tokens after the prefill (the prompt's `prompt_tokens` are processed once and shared)
    greedy_tokens_processed: int = 0  # for the greedy answer
    sample_tokens_processed: int = 0  # row-tokens for all sampled answers together


def one_line(text: str) -> bool:
    """Stop rule for one-line answers: a newline after some text."""
    return "\n" in text.lstrip()


def _finish(tokenizer, ids: list[int], eos: set[int], stop_rule: StopRule | None, limit: int) -> str | None:
    """'stop' / 'length' when the answer `ids` is complete, else None."""
    if ids and ids[-1] in eos:
        return "stop"
    if stop_rule is not None and stop_rule(tokenizer.decode(ids, skip_special_tokens=True)):
        return "stop"
    return "length" if len(ids) >= limit else None


def _answer(tokenizer, ids: list[int], eos: set[int], reason: str) -> Answer:
    ids = ids[:-1] if ids and ids[-1] in eos else ids
    return Answer(tokenizer.decode(ids, skip_special_tokens=True), ids, reason)


def sample_answers(loaded: LoadedModel, prompt_ids: list[int], n: int, temperature: float, max_new_tokens: int,
                   seeds: list[int], stop_rule: StopRule | None = one_line, greedy: bool = True,
                   top_p: float = 1.0, top_k: int = 0) -> AnswerSet:
    """A greedy answer and `n` sampled answers (row i seeded with seeds[i]) after a single prefill."""
    if len(seeds) < n:
        raise ValueError(f"need {n} seeds, got {len(seeds)}")
    tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    out = AnswerSet(prompt_tokens=len(prompt_ids), greedy=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        decoder = BatchDecoder(loaded)
        first_logits = decoder.forward(torch.tensor([prompt_ids]))  # [1, V]
        out.time_prefill_s = time.perf_counter() - t0

        if greedy:
            t0 = time.perf_counter()
            ids: list[int] = []
            logits = first_logits
            while True:
                ids.append(int(logits[0].argmax()))
                reason = _finish(tokenizer, ids, eos, stop_rule, max_new_tokens)
                if reason:
                    break
                logits = decoder.forward(torch.tensor([[ids[-1]]]))
            out.greedy = _answer(tokenizer, ids, eos, reason)
            out.greedy_tokens_processed = len(ids) - 1
            if len(ids) > 1:
                decoder.cache.crop(-(len(ids) - 1))  # back to the prompt alone
            out.time_greedy_s = time.perf_counter() - t0

        if n > 0:
            t0 = time.perf_counter()
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
            generators = [torch.Generator().manual_seed(int(s)) for s in seeds[:n]]
            rows_ids: list[list[int]] = [[] for _ in range(n)]
            reasons: list[str | None] = [None] * n
            active = list(range(n))  # sample index of each batch row
            probs = processed_probs(first_logits, params)  # [1, V]
            next_ids = [int(sample(probs, generators[i])) for i in active]
            decoder.cache.batch_repeat_interleave(n)
            while True:
                still = []
                for row, i in enumerate(active):
                    rows_ids[i].append(next_ids[row])
                    reasons[i] = _finish(tokenizer, rows_ids[i], eos, stop_rule, max_new_tokens)
                    if reasons[i] is None:
                        still.append(row)
                if not still:
                    break
                if len(still) < len(active):
                    decoder.cache.batch_select_indices(torch.tensor(still))
                active = [active[row] for row in still]
                step_input = torch.tensor([[rows_ids[i][-1]] for i in active])  # [rows, 1]
                out.sample_tokens_processed += len(active)
                probs = processed_probs(decoder.forward(step_input), params)  # [rows, V]
                next_ids = [int(sample(probs[row : row + 1], generators[i])) for row, i in enumerate(active)]
            out.samples = [_answer(tokenizer, rows_ids[i], eos, reasons[i]) for i in range(n)]
            out.time_samples_s = time.perf_counter() - t0
    return out
