"""Selection strategies: from one question's record (answers, verdicts) to the answer each strategy gives.

  small-greedy     the small model's greedy answer
  small-majority   majority vote over the first N sampled answers (see `majority`)
  small-verified   majority vote over the verified ones among them; abstain when none is verified
  cascade          small-verified, else the large model's greedy answer
  large-greedy     the large model's greedy answer
  large-verified   the large model's greedy answer if verified, else abstain

Pure functions of the record: the summary, the N curve and the tests all recompute from the same records.
Costs count tokens processed per model (prompt once, plus every generated token of the answers used) and the
wall time of the phases used; the prefill is counted in every strategy that needs it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

STRATEGIES = ("small-greedy", "small-majority", "small-verified", "cascade", "large-greedy", "large-verified")
CURVE_STRATEGIES = ("small-majority", "small-verified", "cascade")


@dataclass
class Selection:
    answer: str | None  # None: abstain
    small_tokens: int = 0
    large_tokens: int = 0
    wall_s: float = 0.0


def majority(answers: list[str], keys: list[str]) -> str | None:
    """The most common key wins (ties: the key seen first); it is given in its most common written form
    (ties: the shortest, then the first seen), so "60", "60 weddings", "60" answers "60". None for no answers."""
    if not answers:
        return None
    counts = Counter(keys)
    best = max(counts.values())
    winner = next(k for k in keys if counts[k] == best)
    forms = [a for a, k in zip(answers, keys) if k == winner]
    form_counts = Counter(forms)
    return min(forms, key=lambda a: (-form_counts[a], len(a), forms.index(a)))


def select(record: dict, strategy: str, n: int) -> Selection:
    """The answer `strategy` gives on this record with the first `n` small samples."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    small, large = record["small"], record["large"]
    samples = small["samples"][:n]
    if strategy == "small-greedy":
        g = small["greedy"]
        return Selection(g["answer"], small["prompt_tokens"] + g["tokens"],
                         wall_s=small["time_prefill_s"] + small["time_greedy_s"])
    if strategy in ("large-greedy", "large-verified"):
        g = large["greedy"]
        wall = large["time_prefill_s"] + large["time_greedy_s"]
        if strategy == "large-greedy":
            return Selection(g["answer"], 0, large["prompt_tokens"] + g["tokens"], wall)
        answer = g["answer"] if g["verdict"]["ok"] else None
        return Selection(answer, 0, large["prompt_tokens"] + g["tokens"], wall + g["verify_s"])
    # the sampled strategies: wall time is known for the whole batch of samples (n = all of them)
    tokens = small["prompt_tokens"] + sum(s["tokens"] for s in samples)
    wall = small["time_prefill_s"] + small["time_samples_s"]
    if strategy == "small-majority":
        return Selection(majority([s["answer"] for s in samples], [s["key"] for s in samples]), tokens, wall_s=wall)
    verified = [s for s in samples if s["verdict"]["ok"]]
    wall += sum(s["verify_s"] for s in samples)
    answer = majority([s["answer"] for s in verified], [s["key"] for s in verified])
    if strategy == "small-verified" or answer is not None:
        return Selection(answer, tokens, wall_s=wall)
    fallback = select(record, "large-greedy", n)  # cascade, nothing verified
    return Selection(fallback.answer, tokens, fallback.large_tokens, wall + fallback.wall_s)
