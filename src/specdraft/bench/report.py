"""From records to numbers, tables and figures. Every number of summary.json follows from records.jsonl:

- tokens_per_s: per prompt, its new tokens over its wall time (all turns), then the mean over prompts
  (Spec-Bench's speed); speedup: that mean over the baseline's mean on the same prompts (baseline `hf-ar`,
  or `ar` when transformers was not run);
- mean_accepted (τ): tokens emitted per target pass, the recovered/bonus token included:
  (accepted + passes) / passes, summed over turns; it counts what the passes produced, before EOS or the token
  budget cut the output;
- acceptance_rate: accepted / drafted; alpha: accepted / examined (a pass examines its accepted tokens and
  the one it rejected), the per-token estimate under which τ should follow (1 − α^(γ+1)) / (1 − α);
- identical_to_ar: the fraction of turns whose greedy output equals the `ar` output token for token, length
  included; first_divergence lists, for the others, the first position that differs;
- peers (llama.cpp, when it ran): its prompt and generation rates from its own timings beside ours, pooled over
  turns, and whether its outputs equal our `ar`'s (its speculative decoding's also against its plain decoding);
- speedup_interval: a 95 % interval of the overall speedup, from a paired bootstrap over prompts
  (`paired_speed_ratio`); `versus` holds the same paired ratio and interval of every method against each
  method named by --versus.

    python -m specdraft.bench.report DIR [--versus LABEL ...]   # rebuild summary.json, report.md and figures
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from itertools import zip_longest
from pathlib import Path

from ..draft_length import expected_tokens, expected_tokens_over_passes
from ..errors import SpecdraftError
from ..jsonl import read_jsonl

OVERALL = "overall"
AUTO = "auto"  # a column whose passes chose their own draft lengths
INTERVAL_LEVEL = 0.95
RESAMPLES = 4000  # bootstrap draws: the ends' Monte Carlo spread is a few hundredths of the ratio's standard error
FEW_PROMPTS = 4  # per category; below it the intervals run narrow (see _few_prompts)
VERSUS_HELP = ("compare every method with this one (a label of --methods, e.g. 'sorted[sorted_exits=24]'): the "
               "ratio of their speeds over the prompts both ran, a 95%% interval from a paired bootstrap over "
               "prompts, and a verdict; repeatable")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def predicted_tau(alpha: float | None, gamma: int | str | None, counted: list[dict]) -> float | None:
    """The i.i.d. expectation at alpha: at the configured gamma, or for gamma "auto" averaged over the lengths the
    passes drafted (pooled over the counted records); None for methods without a chain length (trees, ar)."""
    if alpha is None or not gamma:
        return None
    if gamma == AUTO:
        pooled = [sum(col) for col in zip_longest(*(r["drafted_per_position"] or [] for r in counted), fillvalue=0)]
        return expected_tokens_over_passes(alpha, sum(r["target_passes"] for r in counted), pooled)
    return expected_tokens(alpha, gamma)


def gamma_label(records: list[dict]) -> int | str | None:
    """A column's gamma as reports show it: the number, "auto" when its passes chose their lengths, or None."""
    if any((r.get("stats") or {}).get("gamma_auto") for r in records):
        return AUTO
    return records[0]["gamma"]


def _by_prompt(records: list[dict]) -> dict[str, list[dict]]:
    per_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        per_prompt[r["question_id"]].append(r)
    return per_prompt


def _speed(turns: list[dict], without_prefill: bool = False) -> float:
    """A prompt's new tokens over its wall time, all turns together (optionally leaving each turn's prefill out)."""
    seconds = sum(r["wall_s"] - (r["time_prefill_s"] if without_prefill else 0.0) for r in turns)
    return _ratio(sum(r["new_tokens"] for r in turns), seconds) or 0.0


def prompt_speeds(records: list[dict]) -> dict[str, float]:
    """Per prompt (question_id): its speed, Spec-Bench's (`_speed`)."""
    return {qid: _speed(turns) for qid, turns in _by_prompt(records).items()}


def paired_speed_ratio(mine: list[dict], theirs: list[dict], level: float = INTERVAL_LEVEL,
                       resamples: int = RESAMPLES, seed: int = 0) -> dict | None:
    """(mean prompt speed of `mine`) / (mean prompt speed of `theirs`) over the prompts both ran, the report's
    speedup when both ran the same prompts, with an interval: {"ratio", "interval": [low, high], "prompts"}.

    Percentile bootstrap: each draw takes prompts with replacement within each category (so every draw keeps
    the suite's mix), and the same prompts for both sides. Pairing cancels what the two share: a prompt that is
    slow for every method, and machine drift, since the bench interleaves methods per prompt. A draw of n prompts
    from n spreads its mean by only (n − 1) / n of the variance the n prompts stand for, so each category draws
    n − 1 prompts and counts them n / (n − 1) times (Rao and Wu's rescaled bootstrap): without it, 2 prompts per
    category gave a 95 % interval that held the truth 3 times in 4. Categories with a single shared prompt have
    nothing to draw from; when there is one, all prompts are drawn as one group. The interval covers which
    prompts were drawn and the timing noise of one run per method on them, not another machine.
    None when fewer than two prompts are shared or `theirs` has no speed."""
    import numpy as np

    speeds_mine, speeds_theirs = prompt_speeds(mine), prompt_speeds(theirs)
    category = {r["question_id"]: r["category"] for r in mine}
    shared = sorted(set(speeds_mine) & set(speeds_theirs))
    a = np.array([speeds_mine[q] for q in shared])  # [P]
    b = np.array([speeds_theirs[q] for q in shared])  # [P]
    if len(shared) < 2 or b.sum() <= 0:
        return None
    groups: dict[str, list[int]] = defaultdict(list)
    for i, q in enumerate(shared):
        groups[category[q]].append(i)
    if min(len(members) for members in groups.values()) < 2:
        groups = {"all": list(range(len(shared)))}
    rng = np.random.default_rng(seed)
    sum_a, sum_b = np.zeros(resamples), np.zeros(resamples)
    for members in groups.values():
        members = np.array(members)
        n = len(members)
        drawn = members[rng.integers(0, n, size=(resamples, n - 1))]  # [R, n - 1] prompt indices
        sum_a += a[drawn].sum(axis=1) * n / (n - 1)
        sum_b += b[drawn].sum(axis=1) * n / (n - 1)
    if (sum_b <= 0).any():  # a draw of prompts the reference produced nothing on: no ratio to speak of
        return None
    low, high = np.quantile(sum_a / sum_b, [(1 - level) / 2, (1 + level) / 2])
    return {"ratio": float(a.sum() / b.sum()), "interval": [float(low), float(high)], "prompts": len(shared)}


def versus_table(records: list[dict], labels: list[str], reference: str) -> dict[str, dict | None]:
    """Every other method against `reference`: paired_speed_ratio over the prompts both ran (None: too few)."""
    theirs = [r for r in records if r["label"] == reference]
    return {label: paired_speed_ratio([r for r in records if r["label"] == label], theirs)
            for label in labels if label != reference}


def compare_tokens(candidate: list[int], reference: list[int]) -> tuple[bool, int | None]:
    """(identical, first divergence): identical only if every token AND the length agree; the first divergence
    is the first differing position, or the shorter length when one output is a prefix of the other."""
    for position, (a, b) in enumerate(zip(candidate, reference, strict=False)):  # lengths checked below
        if a != b:
            return False, position
    if len(candidate) != len(reference):
        return False, min(len(candidate), len(reference))
    return True, None


def read_records(path: Path) -> list[dict]:
    """The records of a run; a line cut off by a kill mid-write (the last one) is dropped."""
    records, _ = read_jsonl(path, "the records file was edited or is corrupt, use --overwrite to start afresh")
    if not all(isinstance(r, dict) for r in records):
        raise SpecdraftError(f"{path} holds lines that are not records; use --overwrite to start afresh")
    return records


def group_stats(records: list[dict], gamma: int | str | None) -> dict:
    per_prompt = _by_prompt(records)
    speeds = [_speed(turns) for turns in per_prompt.values()]
    # the same without the prompt's prefill, for our loop (which times it): at temperature 1 each method's answer
    # is another sample, and a long prompt's prefill over a short answer would otherwise dominate its speed
    timed = all(r.get("time_prefill_s") is not None for r in records)
    decode_speeds = [_speed(turns, without_prefill=True) for turns in per_prompt.values()] if timed else []
    counted = [r for r in records if r.get("target_passes")]
    passes = sum(r["target_passes"] for r in counted)
    accepted = sum(r["accepted"] for r in counted)
    alpha = _ratio(accepted, sum(r["examined"] for r in counted))
    flags = [r["identical_to_ar"] for r in records if r.get("identical_to_ar") is not None]
    return {
        "prompts": len(per_prompt), "turns": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records), "wall_s": sum(r["wall_s"] for r in records),
        "tokens_per_s": sum(speeds) / len(speeds),
        "speedup": None,  # filled in against the baseline
        "speedup_interval": None,  # overall only: [low, high] of the paired bootstrap (paired_speed_ratio)
        "decode_tokens_per_s": sum(decode_speeds) / len(decode_speeds) if timed else None,
        "decode_speedup": None,  # filled in against our ar
        "target_passes": passes or None,
        "mean_accepted": _ratio(accepted + passes, passes),
        "acceptance_rate": _ratio(accepted, sum(r["drafted"] for r in counted)),
        "alpha": alpha,
        "predicted_tau": predicted_tau(alpha, gamma, counted) if counted else None,
        "identical_to_ar": _ratio(sum(flags), len(flags)),
        "identical_turns": f"{sum(flags)}/{len(flags)}" if flags else None,
        "first_divergence": sorted(r["first_divergence"] for r in records if r.get("identical_to_ar") is False),
        "by_label": label_tallies(records),
        "steps_by_source": step_tallies(records),
    }


def label_tallies(records: list[dict]) -> dict | None:
    """Drafted and accepted tokens per draft label (e.g. the sorted exit that drafted them), summed."""
    drafted: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    for r in records:
        stats = r.get("stats") or {}
        tally = stats.get("drafter") or stats  # the drafter's own counters (Drafter.new_tally; before 2026-12-03 at
        # the top of the statistics)
        for label, n in (tally.get("drafted_by") or {}).items():
            drafted[label] += n
        for label, n in (tally.get("accepted_by") or {}).items():
            accepted[label] += n
    return {label: {"drafted": n, "accepted": accepted.get(label, 0)} for label, n in drafted.items()} or None


def step_tallies(records: list[dict]) -> dict | None:
    """Chain passes per draft source (the drafter's guesses, lookup-first copies), summed: per draft step, the
    passes that reached it (every earlier step kept) and those that kept it (SpecStats.steps_by_source)."""
    sums: dict[str, dict[str, list[int]]] = {}
    for r in records:
        for source, steps in ((r.get("stats") or {}).get("steps_by_source") or {}).items():
            into = sums.setdefault(source, {"reached": [], "kept": []})
            for name in ("reached", "kept"):
                into[name] += [0] * (len(steps[name]) - len(into[name]))
                for i, n in enumerate(steps[name]):
                    into[name][i] += n
    return sums or None


PEER_REFERENCE = "llama.cpp"  # the peer's plain decoding: its speculative decoding is also compared with it


def _is_peer(record: dict) -> bool:
    return (record.get("stats") or {}).get("peer_predicted_ms") is not None


def _peer_sum(records: list[dict], name: str) -> float:
    return sum((r["stats"] or {}).get(f"peer_{name}") or 0 for r in records)


def peer_rates(records: list[dict]) -> dict | None:
    """Prompt and generation rates, pooled over turns (all tokens over all seconds). llama.cpp's from its own
    timings: prompt_n / prompt_ms and predicted_n / predicted_ms (predicted_n counts its end-of-generation
    token), and, for its speculative decoding, draft_n_accepted / draft_n; also its tokens over the whole request
    as our side saw it (HTTP and JSON included). Ours: prompt tokens over prefill time and new tokens over the
    rest of the wall time. None for a method that times neither (transformers)."""
    if not records:
        return None
    if all(_is_peer(r) for r in records):
        drafted = _peer_sum(records, "draft_n")
        http_s = _peer_sum(records, "http_wall_s")
        return {"source": "its own timings",
                "prompt_tokens_per_s": _ratio(_peer_sum(records, "prompt_n"), _peer_sum(records, "prompt_ms") / 1000),
                "decode_tokens_per_s": _ratio(_peer_sum(records, "predicted_n"),
                                              _peer_sum(records, "predicted_ms") / 1000),
                "request_tokens_per_s": _ratio(sum(r["new_tokens"] for r in records), http_s),
                "draft_acceptance": _ratio(_peer_sum(records, "draft_n_accepted"), drafted) if drafted else None,
                "version": (records[0]["stats"] or {}).get("peer_version")}
    if all(r.get("time_prefill_s") is not None for r in records):
        prefill_s = sum(r["time_prefill_s"] for r in records)
        return {"source": "our loop's timers",
                "prompt_tokens_per_s": _ratio(sum(r["prompt_tokens"] for r in records), prefill_s),
                "decode_tokens_per_s": _ratio(sum(r["new_tokens"] for r in records),
                                              sum(r["wall_s"] for r in records) - prefill_s),
                "request_tokens_per_s": None, "draft_acceptance": None, "version": None}
    return None


def peer_table(records: list[dict], labels: list[str]) -> dict | None:
    """Per label, `peer_rates`, and for llama.cpp's speculative decoding the equality with its plain decoding
    (greedy outputs of the same prompt and turn). None when no peer ran."""
    if not any(_is_peer(r) for r in records):
        return None
    reference = {(r["question_id"], r["turn"]): r["output_ids"] for r in records if r["label"] == PEER_REFERENCE}
    table = {}
    for label in labels:
        mine = [r for r in records if r["label"] == label]
        rates = peer_rates(mine)
        if rates is None:
            continue
        if label != PEER_REFERENCE and all(_is_peer(r) for r in mine) and reference:
            pairs = [compare_tokens(r["output_ids"], reference[(r["question_id"], r["turn"])]) for r in mine
                     if (r["question_id"], r["turn"]) in reference]
            rates["identical_to_peer_turns"] = f"{sum(same for same, _ in pairs)}/{len(pairs)}"
            rates["first_divergence_from_peer"] = sorted(at for same, at in pairs if not same)
        table[label] = rates
    return table


def check_versus(versus: tuple[str, ...], labels: list[str]) -> None:
    """A clear error for a --versus label that is not one of the run's methods."""
    unknown = [v for v in versus if v not in labels]
    if unknown:
        raise SpecdraftError(f"--versus {', '.join(map(repr, unknown))}: not a method of this run; its methods "
                             f"are {', '.join(labels)}")


def summarize(records: list[dict], info: dict, versus: tuple[str, ...] = ()) -> dict:
    """versus: labels to compare every method against, pair by pair, with intervals (summary["versus"])."""
    labels = list(dict.fromkeys(r["label"] for r in records))
    check_versus(versus, labels)
    categories = list(dict.fromkeys(r["category"] for r in records))
    baseline = "hf-ar" if "hf-ar" in labels else "ar" if "ar" in labels else None
    results: dict[str, dict] = {}
    methods: dict[str, dict] = {}
    for label in labels:
        mine = [r for r in records if r["label"] == label]
        gamma = gamma_label(mine)
        # our loop reports its passes; a method without them (transformers) runs another forward implementation
        methods[label] = {"method": mine[0]["method"], "gamma": gamma,
                          "our_loop": any(r.get("target_passes") is not None for r in mine)}
        results[label] = {c: group_stats([r for r in mine if r["category"] == c], gamma) for c in categories}
        results[label][OVERALL] = group_stats(mine, gamma)
    if baseline:
        for label in labels:
            for group, stats in results[label].items():
                stats["speedup"] = _ratio(stats["tokens_per_s"], results[baseline][group]["tokens_per_s"])
        for label, paired in versus_table(records, labels, baseline).items():
            results[label][OVERALL]["speedup_interval"] = paired and paired["interval"]
    if "ar" in labels:
        for label in labels:
            for group, stats in results[label].items():
                ours, base = stats["decode_tokens_per_s"], results["ar"][group]["decode_tokens_per_s"]
                stats["decode_speedup"] = _ratio(ours, base) if ours is not None and base is not None else None
    return {**info, "baseline": baseline, "categories": categories, "methods": methods, "results": results,
            "versus": {reference: versus_table(records, labels, reference) for reference in versus},
            "peers": peer_table(records, labels)}


# ------------------------------------------------------------------------------------------------ tables

def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(summary: dict) -> str:
    """Markdown tables: speedup per category, then the overall figures per method."""
    cats, res = summary["categories"], summary["results"]
    base = summary["baseline"] or "-"
    lines = [f"Speedup against `{base}` (mean tokens/s over the baseline's mean tokens/s):", "",
             "| method | " + " | ".join(cats) + f" | {OVERALL} |", "|---" * (len(cats) + 2) + "|"]
    for label, groups in res.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(groups[c]["speedup"], ".2f", "x") for c in cats + [OVERALL])
                     + " |")
    if any(groups[OVERALL]["decode_speedup"] is not None for groups in res.values()):
        lines += ["", ("Decode-only speedup against `ar` (each turn's prefill left out, a draft model's own prefill with it, "
                  "which flatters model drafters; our methods, and llama.cpp by its own prompt timing; the "
                  "end-to-end speedup above is the figure of record):"), "",
                  "| method | " + " | ".join(cats) + f" | {OVERALL} |", "|---" * (len(cats) + 2) + "|"]
        for label, groups in res.items():
            if groups[OVERALL]["decode_speedup"] is not None:
                lines.append(f"| {label} | " + " | ".join(_fmt(groups[c]["decode_speedup"], ".2f", "x")
                                                       for c in cats + [OVERALL]) + " |")
    lines += ["", "Tokens per second:", "", "| method | " + " | ".join(cats) + f" | {OVERALL} |",
              "|---" * (len(cats) + 2) + "|"]
    for label, groups in res.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(groups[c]["tokens_per_s"]) for c in cats + [OVERALL]) + " |")
    lines += ["", f"| method | γ | tok/s | speedup | {INTERVAL_LEVEL:.0%} interval | τ (mean accepted) | predicted τ "
                  "| acceptance rate | α | identical to ar |", "|---" * 10 + "|"]
    for label, groups in res.items():
        o = groups[OVERALL]
        lines.append(f"| {label} | {_fmt(summary['methods'][label]['gamma'], '')} | {_fmt(o['tokens_per_s'])} | "
                     f"{_fmt(o['speedup'], '.2f', 'x')} | {_interval(o.get('speedup_interval'))} | "
                     f"{_fmt(o['mean_accepted'])} | {_fmt(o['predicted_tau'])} | "
                     f"{_fmt(o['acceptance_rate'])} | {_fmt(o['alpha'])} | {o['identical_turns'] or '-'} |")
    return "\n".join(lines)


def _interval(interval: list[float] | None) -> str:
    return "-" if not interval else f"{interval[0]:.2f}–{interval[1]:.2f}"


def versus_section(summary: dict) -> list[str]:
    """Per reference named by --versus: every method's speed over the reference's on the prompts both ran, the
    paired interval, and whether the interval excludes 1 (a difference this set of prompts resolves)."""
    lines = []
    for reference, table in (summary.get("versus") or {}).items():
        lines += [f"## Paired comparison against `{reference}`", "",
                  f"Tokens/s over `{reference}`'s on the prompts both ran, with a {INTERVAL_LEVEL:.0%} interval from a "
                  "bootstrap over prompts drawn within each category, the same prompts for both sides. Each row is "
                  "its own test: among many rows, one in twenty may say faster or slower by chance.", "",
                  f"| method | prompts | ratio | {INTERVAL_LEVEL:.0%} interval | verdict |", "|---|---|---|---|---|"]
        for label, row in table.items():
            if row is None:
                lines.append(f"| {label} | - | - | - | too few shared prompts |")
                continue
            low, high = row["interval"]
            verdict = "faster" if low > 1 else "slower" if high < 1 else "not resolved"
            lines.append(f"| {label} | {row['prompts']} | {row['ratio']:.3f} | {_interval(row['interval'])} | "
                         f"{verdict} |")
        lines.append("")
    return lines


def peer_section(summary: dict) -> list[str]:
    """llama.cpp beside ours: prompt and generation rates, and whether its greedy outputs equal our `ar`'s."""
    table = summary.get("peers")
    if not table:
        return []
    results = summary["results"]
    version = next((row["version"] for row in table.values() if row.get("version")), None)
    dtype = summary["settings"].get("dtype_resolved")
    arithmetic = ("Both compute on the GGUF's quantized blocks with 8-bit activations, each with its own kernels "
                  "(sums ordered and rounded differently)" if dtype == "gguf" else
                  f"It computes on the GGUF's quantized blocks with 8-bit activations, ours on the weights "
                  f"dequantized to {dtype}")
    lines = ["## Outside peer: llama.cpp", "",
             f"{version or 'llama.cpp'} (`make peers`) on the GGUF file our target was converted from, the same prompt "
             "token ids, greedy, no prompt cache, interleaved with our methods. Its rows are timed by its own clock "
             "(prompt_ms + predicted_ms: the tokens/s and speedups above use them, and leave out the HTTP "
             "request, whose rate is the request column); rates are pooled over turns. Its generation rate is "
             "predicted_n / predicted_ms, its end-of-generation token counted; ours is new tokens over the wall "
             f"time after prefill. {arithmetic}, so greedy outputs may part where two logits nearly tie.", "",
             "| method | timed by | prompt tok/s | generation tok/s | request tok/s | tok/s (end to end) "
             "| draft acceptance | identical to ar | first divergence from ar | identical to llama.cpp |",
             "|---" * 10 + "|"]
    for label, row in table.items():
        overall = results[label][OVERALL]
        divergence = ", ".join(map(str, overall["first_divergence"])) or "-"
        to_peer = row.get("identical_to_peer_turns") or "-"
        if row.get("first_divergence_from_peer"):
            to_peer += f" (first divergence at {', '.join(map(str, row['first_divergence_from_peer']))})"
        lines.append(f"| {label} | {row['source']} | {_fmt(row['prompt_tokens_per_s'], '.1f')} | "
                     f"{_fmt(row['decode_tokens_per_s'])} | {_fmt(row['request_tokens_per_s'])} | "
                     f"{_fmt(overall['tokens_per_s'])} | {_fmt(row['draft_acceptance'])} | "
                     f"{overall['identical_turns'] or '-'} | {divergence} | {to_peer} |")
    return lines + [""]


def _few_prompts(summary: dict) -> str:
    """The caveat for a run with few prompts per category (empty when there is none)."""
    if not summary["baseline"]:
        return ""
    fewest = min((groups[c]["prompts"] for groups in summary["results"].values() for c in summary["categories"]),
                 default=0)
    if fewest >= FEW_PROMPTS:
        return ""
    if fewest < 2:
        return (" This run has a category with a single prompt: its prompts are drawn as one group, whatever "
                "their category.")
    return (f" This run has {fewest} prompts in its smallest category: below {FEW_PROMPTS} the intervals run narrow "
            "(in simulation, a 95 % interval from 2 prompts per category held the truth 87 % of the time).")


def _backend(summary: dict, role: str) -> str:
    return (summary.get(role) or {}).get("backend", "-")


def _load(values) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2 ** 30:.2f} GiB"


def _segments(summary: dict) -> list[str]:
    """A resumed run ran in parts: when each ran, how many prompts, and the load average around it."""
    segments = summary.get("segments") or []
    if len(segments) < 2:
        return []
    parts = [f"{seg['started']} ({seg['prompts_run']} prompts, load {_load(seg.get('load_average_at_start'))} → "
             f"{_load(seg.get('load_average_at_end'))})" for seg in segments]
    return [f"Resumed run, {len(segments)} parts (`--resume`): " + "; ".join(parts) + "."]


def format_report(summary: dict, figures: list[str]) -> str:
    s = summary["settings"]
    mem = summary.get("memory", {})
    lines = [
        "# Benchmark report", "",
        f"Date: {summary['date']}. Machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores, "
        f"torch CPU capability {summary['machine']['torch_cpu_capability']}, {summary['threads']} threads; "
        f"torch {summary['versions']['torch']}, transformers {summary['versions']['transformers']}; "
        f"load average (1, 5, 15 min) at start {_load(summary['machine'].get('load_average_at_start'))}, at end "
        f"{_load(summary['machine'].get('load_average_at_end'))} (above the thread count means other processes "
        "competed for the cores).",
        f"Target `{s['target']}`, draft `{s['draft']}`, dtype {s['dtype']} (resolved: {s['dtype_resolved']}); "
        f"{'greedy' if s['temperature'] == 0 else 'temperature ' + str(s['temperature'])}, "
        f"{s['max_new_tokens']} new tokens per turn, γ {', '.join(AUTO if g is None else str(g) for g in s['gammas'])}, "
        f"{'chat template' if s['chat'] else 'raw prompts'}; our backend: target {_backend(summary, 'target')}, "
        f"draft {_backend(summary, 'draft')} (transformers' methods always run the model's own forward).",
        f"Command: `{s['command']}`", *_segments(summary), "",
        format_table(summary), "",
        *([f"The interval is a {INTERVAL_LEVEL:.0%} paired bootstrap over prompts (drawn within each category) of "
           "the overall speedup: it shows how much the figure rests on which prompts were drawn."
           + _few_prompts(summary), ""] if summary["baseline"] else []),
        *versus_section(summary),
        *peer_section(summary),
        "τ counts the tokens each target pass produced (accepted + 1); α = accepted / examined; predicted τ = "
        "(1 − α^(γ+1)) / (1 − α) at the configured γ, or for γ auto averaged over the lengths the passes drafted "
        "(prompt lookup drafts fewer than γ when nothing matches, so its prediction at a fixed γ is an upper "
        "bound). transformers' methods do not expose their passes (\"-\").", "",
        "## Memory", "",
        f"- target weights {_gib(mem.get('target_weight_bytes'))}; draft weights "
        f"{_gib(mem.get('draft_weight_bytes'))}",
        f"- KV cache at the end of the longest turn ({mem.get('longest_turn', {}).get('tokens')} tokens, "
        f"{mem.get('longest_turn', {}).get('question_id')}): target {_gib(mem.get('target_kv_bytes_longest_turn'))}, "
        f"draft {_gib(mem.get('draft_kv_bytes_longest_turn'))} (2 · layers · kv heads · head dim · tokens · bytes)",
        f"- peak resident memory of the process {_gib(mem.get('peak_rss_bytes'))}", "",
    ]
    lines += label_section(summary)
    lines += step_section(summary)
    lines += startup_section(summary.get("startup"))
    lines += divergence_section(summary)
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def label_section(summary: dict) -> list[str]:
    """Per method with labelled drafts: how many tokens each label (sorted exit) drafted and had accepted."""
    lines = []
    for label, groups in summary["results"].items():
        tallies = groups[OVERALL].get("by_label")
        if not tallies:
            continue
        parts = [f"{name}: {t['accepted']}/{t['drafted']} accepted ({t['accepted'] / t['drafted']:.2f})"
                 for name, t in sorted(tallies.items(), key=lambda kv: (len(kv[0]), kv[0])) if t["drafted"]]
        lines.append(f"- {label}: " + "; ".join(parts))
    return (["## Drafted and accepted per draft label", ""] + lines + [""]) if lines else []


STEPS_SHOWN = 4  # draft steps the per-source table shows (later ones are rarely reached)


def step_section(summary: dict) -> list[str]:
    """Per method and draft source, the acceptance at each draft step given the steps before it: the online twin
    of a head's offline agreement (scripts/eagle_agreement.py), comparable step by step."""
    lines = []
    for label, groups in summary["results"].items():
        for source, steps in sorted((groups[OVERALL].get("steps_by_source") or {}).items()):
            cells = [f"{k}/{r} ({k / r:.2f})" if r else "-"
                     for r, k in zip(steps["reached"][:STEPS_SHOWN], steps["kept"][:STEPS_SHOWN])]
            cells += ["-"] * (STEPS_SHOWN - len(cells))
            lines.append(f"| {label} | {source} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    header = "| method | source | " + " | ".join(f"step {i + 1}" for i in range(STEPS_SHOWN)) + " |"
    return ["## Acceptance per draft step and source (chains)", "",
            "Kept / reached: a pass reaches step i when it drafted it and kept every step before it. `lookup` is a "
            "lookup-first copy, `drafter` the drafter's own guess.", "",
            header, "|---" * (STEPS_SHOWN + 2) + "|", *lines, ""]


def startup_section(startup: dict | None) -> list[str]:
    """One-off costs (model loading, the native kernels' build or import, each method's warm-up): paid once per
    process, never inside a timed generation."""
    if not startup:
        return []
    kernels = startup.get("native_kernels", {})
    kernel_text = kernels.get("kernels", "-")
    if "isa" in kernels:
        kernel_text += f" ({kernels['isa'].upper()})"
    if "seconds" in kernels:
        kernel_text += f" in {kernels['seconds']:.1f} s"
    warmups = ", ".join(f"{label} {s:.1f} s" for label, s in startup.get("warmup_s", {}).items()) or "-"
    loads = ", ".join(f"{role} {startup[key]:.1f} s" for role, key in (("target", "target_load_s"),
                                                                        ("draft", "draft_load_s")) if key in startup)
    return ["## Start-up (once per process, outside every timing)", "",
            f"- model loading: {loads or '-'}", f"- native kernels: {kernel_text} (built once per machine into the "
            "specdraft cache, imported afterwards)", f"- warm-up generation per method: {warmups}", ""]


def divergence_section(summary: dict) -> list[str]:
    res, s = summary["results"], summary["settings"]
    if s["temperature"] != 0:
        return ["Sampling run: outputs are equal to `ar` in distribution, not token by token; no equality check.",
                ""]
    diverged = {label: g[OVERALL] for label, g in res.items() if g[OVERALL]["first_divergence"]}
    if not diverged:
        return ["Greedy equality: every output equals the `ar` output token for token, length included.", ""]
    lines = ["## Divergence from `ar` (greedy)", ""]
    # our loop on the native backend is batch invariant in every dtype, on transformers only (nearly) in fp32
    if s["dtype_resolved"] == "float32" or (summary.get("target") or {}).get("backend") == "native":
        ours = [label for label in diverged if summary["methods"][label].get("our_loop")]
        if ours:
            lines += [f"**{', '.join(ours)}: outputs of our own loop that differ from `ar` are not expected "
                      "(same forward, greedy): investigate before trusting a number.**", ""]
        if len(ours) < len(diverged):
            lines += ["Methods outside our loop run a different forward implementation (transformers in "
                      f"{s['dtype_resolved']} arithmetic; llama.cpp on the GGUF's quantized blocks with its own "
                      "kernels) whose sums are ordered and rounded differently; where two logits nearly tie, "
                      "the argmax can flip.", ""]
    else:
        lines += [f"In {s['dtype_resolved']} the target is not batch-invariant: a k-token verify rounds differently "
                  "from a 1-token step, and a near-tie argmax can flip. The divergence rate is reported as its "
                  "own figure; exactness is checked in float32.", ""]
    lines += ["| method | divergence rate | turns | first divergence at token |", "|---|---|---|---|"]
    for label, o in diverged.items():
        lines.append(f"| {label} | {1 - o['identical_to_ar']:.2f} | {o['identical_turns']} identical | "
                     f"{', '.join(map(str, o['first_divergence']))} |")
    return lines + [""]


# ------------------------------------------------------------------------------------------------ figures

def write_figures(summary: dict, records: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    cats, res = summary["categories"], summary["results"]
    labels = list(res)

    if summary["baseline"]:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * (len(cats) + 1)), 4))
        width = 0.8 / len(labels)
        groups = cats + [OVERALL]
        for i, label in enumerate(labels):
            ax.bar([g + i * width for g in range(len(groups))],
                   [res[label][c]["speedup"] or 0 for c in groups], width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20)
        ax.set_ylabel(f"speedup vs {summary['baseline']}")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("Speedup per category")
        fig.tight_layout()
        fig.savefig(out / "speedup_by_category.png", dpi=110)
        plt.close(fig)
        written.append("speedup_by_category.png")

    spec_labels = [label for label in labels if res[label][OVERALL]["alpha"] is not None]
    if spec_labels:
        import numpy as np

        fig, ax = plt.subplots(figsize=(6, 4.2))
        alphas = np.linspace(0, 0.999, 200)
        # a tree method has no gamma (its depth and budget shape it): no chain curve for it
        fixed = {summary["methods"][label]["gamma"] for label in spec_labels} - {None, AUTO}
        for gamma in sorted(fixed):
            ax.plot(alphas, (1 - alphas ** (gamma + 1)) / (1 - alphas), linestyle="--", linewidth=1,
                    label=f"(1−α^(γ+1))/(1−α), γ={gamma}")
        for label in spec_labels:
            points = [(r["accepted"] / r["examined"], (r["accepted"] + r["target_passes"]) / r["target_passes"])
                      for r in records if r["label"] == label and r.get("examined")]
            line = ax.scatter(*zip(*points), s=10, alpha=0.35) if points else None
            o = res[label][OVERALL]
            ax.scatter([o["alpha"]], [o["mean_accepted"]], s=70, marker="D", edgecolor="black",
                       color=line.get_facecolor()[0] if line else None, label=f"{label} (all turns)")
        ax.set_xlabel("α = accepted / examined")
        ax.set_ylabel("τ = tokens per target pass")
        ax.set_title("Measured τ against the i.i.d. prediction (dots: turns)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "tau_vs_alpha.png", dpi=110)
        plt.close(fig)
        written.append("tau_vs_alpha.png")

    gammas = summary["settings"]["gammas"]
    swept = defaultdict(list)  # method -> [(gamma, label)]
    for label, m in summary["methods"].items():
        if isinstance(m["gamma"], int):  # an auto column has no place on the gamma axis
            swept[m["method"]].append((m["gamma"], label))
    if len(gammas) > 1 and swept:
        fig, (ax_speed, ax_tau) = plt.subplots(1, 2, figsize=(9, 3.8))
        for method, points in swept.items():
            points.sort()
            xs = [g for g, _ in points]
            ax_speed.plot(xs, [res[lb][OVERALL]["speedup"] or 0 for _, lb in points], marker="o", label=method)
            taus = [res[lb][OVERALL]["mean_accepted"] for _, lb in points]
            if all(t is not None for t in taus):
                ax_tau.plot(xs, taus, marker="o", label=f"{method} measured")
                ax_tau.plot(xs, [res[lb][OVERALL]["predicted_tau"] for _, lb in points], linestyle="--",
                            label=f"{method} predicted")
        ax_speed.axhline(1.0, color="black", linewidth=0.8)
        ax_speed.set_xlabel("γ")
        ax_speed.set_ylabel(f"speedup vs {summary['baseline']}")
        ax_tau.set_xlabel("γ")
        ax_tau.set_ylabel("τ")
        for ax in (ax_speed, ax_tau):
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "gamma_sweep.png", dpi=110)
        plt.close(fig)
        written.append("gamma_sweep.png")

    diverged = {lb: res[lb][OVERALL]["first_divergence"] for lb in labels if res[lb][OVERALL]["first_divergence"]}
    if diverged:
        fig, ax = plt.subplots(figsize=(6, 0.6 + 0.45 * len(diverged)))
        for i, positions in enumerate(diverged.values()):
            ax.scatter(positions, [i] * len(positions), marker="|", s=200)
        ax.set_yticks(range(len(diverged)), list(diverged))
        ax.set_xlabel("first token that differs from ar")
        ax.set_xlim(0, summary["settings"]["max_new_tokens"])
        fig.tight_layout()
        fig.savefig(out / "first_divergence.png", dpi=110)
        plt.close(fig)
        written.append("first_divergence.png")
    return written


def write_report(summary: dict, records: list[dict], out: Path) -> None:
    figures = write_figures(summary, records, out)
    (out / "report.md").write_text(format_report(summary, figures), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdraft.bench.report",
                                     description="Rebuild a bench folder's summary.json, report.md and figures from "
                                     "its records.jsonl.")
    parser.add_argument("folder")
    parser.add_argument("--versus", action="append", default=[], metavar="LABEL",
                        help=VERSUS_HELP + " (added to those the run asked for)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.folder)
    if not (out / "records.jsonl").is_file():
        print(f"error: {out} holds no bench records (records.jsonl)", file=sys.stderr)
        return 2
    if not (out / "summary.json").is_file():
        print(f"error: {out} has records but no summary.json: the run has not finished; finish it with "
              "`specdraft bench ... --resume` (the same settings), which writes the summary", file=sys.stderr)
        return 2
    try:
        records = read_records(out / "records.jsonl")
        old = json.loads((out / "summary.json").read_text())
        info = {k: v for k, v in old.items() if k not in ("baseline", "categories", "methods", "results", "versus")}
        versus = tuple(dict.fromkeys([*(old.get("versus") or ()), *args.versus]))
        summary = summarize(records, info, versus)
    except SpecdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    write_report(summary, records, out)
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
