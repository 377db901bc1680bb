"""Metrics from the records alone: per strategy accuracy (normalised exact match, token F1), coverage,
precision on answered, accuracy with abstentions counted wrong, cost (FLOPs = 2 x parameters x tokens
processed, and wall time), and accuracy against N for N = 1..n.

Words: *asked* = questions; *answered* = questions where the strategy did not abstain;
  coverage  = answered / asked
  precision = EM on answered (the share of given answers that are right)
  accuracy  = EM on asked, an abstention counting as wrong (= coverage x precision)
  f1        = token F1 on asked, an abstention scoring 0
  same value = the answer states the same figure or date as a gold answer (normalize.py), on asked
For the code task "EM" is pass@1 on the hidden tests (F1 the same).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..jsonl import read_jsonl
from .normalize import exact_match, same_value, value_answer
from .strategies import CURVE_STRATEGIES, STRATEGIES, select


def read_records(path: str | Path) -> list[dict]:
    return read_jsonl(Path(path), "the records file was edited or is corrupt; use another --out")[0]


def _grade(record: dict, answer: str | None) -> dict:
    if answer is None:
        return {"em": 0.0, "f1": 0.0, "value": 0.0}
    grade = dict(record["grades"][answer])
    grade["value"] = value_match(answer, record["golds"]) if record["golds"] else grade["em"]
    return grade


def value_match(answer: str, golds: list[str]) -> float:
    """1.0 when the answer gives the same figure or date as a gold answer ("62%" for "62", "2" for "two"), by
    the verifier's normalisation (units may be left out on one side); also 1.0 on a normalised exact match."""
    if exact_match(answer, golds):
        return 1.0
    value = value_answer(answer)
    return float(value is not None and any((g := value_answer(gold)) is not None and same_value(value, g)
                                           for gold in golds))


def strategy_metrics(records: list[dict], strategy: str, n: int, small_params: int, large_params: int) -> dict:
    asked = len(records)
    answered = em = f1 = value = small_tokens = large_tokens = wall = 0.0
    for record in records:
        chosen = select(record, strategy, n)
        grade = _grade(record, chosen.answer)
        answered += chosen.answer is not None
        em += grade["em"]
        f1 += grade["f1"]
        value += grade["value"]
        small_tokens += chosen.small_tokens
        large_tokens += chosen.large_tokens
        wall += chosen.wall_s
    flops = 2 * (small_params * small_tokens + large_params * large_tokens)
    return {"strategy": strategy, "n": n, "asked": asked, "answered": int(answered),
            "coverage": answered / asked if asked else 0.0,
            "precision": em / answered if answered else 0.0,
            "accuracy": em / asked if asked else 0.0,
            "f1": f1 / asked if asked else 0.0,
            "f1_answered": f1 / answered if answered else 0.0,
            "value_accuracy": value / asked if asked else 0.0,
            "tokens_small_per_q": small_tokens / asked if asked else 0.0,
            "tokens_large_per_q": large_tokens / asked if asked else 0.0,
            "gflops_per_q": flops / asked / 1e9 if asked else 0.0,
            "wall_s_per_q": wall / asked if asked else 0.0}


def summarize(records: list[dict], settings: dict) -> dict:
    """The summary table (at the full N) and the accuracy-vs-N curves, from the records alone."""
    if not records:
        return {"settings": settings, "asked": 0, "table": [], "curve": {}}
    n = min(len(r["small"]["samples"]) for r in records)
    sp, lp = settings["small_params"], settings["large_params"]
    table = [strategy_metrics(records, s, n, sp, lp) for s in STRATEGIES]
    curve = {s: [strategy_metrics(records, s, k, sp, lp)["accuracy"] for k in range(1, n + 1)]
             for s in CURVE_STRATEGIES}
    verified = [strategy_metrics(records, "small-verified", k, sp, lp) for k in range(1, n + 1)]
    curve_verified = {"coverage": [m["coverage"] for m in verified], "precision": [m["precision"] for m in verified]}
    return {"settings": settings, "asked": len(records), "n": n, "table": table, "curve": curve,
            "curve_verified": curve_verified}


def report_markdown(summary: dict) -> str:
    s = summary["settings"]
    what = "pass@1 on hidden tests" if s.get("task") == "code" else "normalised EM"
    lines = [f"{summary['asked']} questions, task {s.get('task')}, verifier {s.get('verifier')}, n={summary.get('n')}, "
             f"temperature {s.get('temperature')}, max new tokens {s.get('max_new_tokens')}, {s.get('torch_dtype')}; "
             f"small {s.get('small')}, large {s.get('large')}", "",
             f"| strategy | accuracy ({what}, abstain = wrong) | F1 | same value | coverage | "
             "precision on answered | tokens small / q | tokens large / q | GFLOPs / q | wall s / q |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["table"]:
        name = row["strategy"] + (f" (N={row['n']})" if row["strategy"] in CURVE_STRATEGIES else "")
        lines.append(f"| {name} | {row['accuracy']:.3f} | {row['f1']:.3f} | {row['value_accuracy']:.3f} | "
                     f"{row['coverage']:.3f} | "
                     f"{row['precision']:.3f} | {row['tokens_small_per_q']:.1f} | {row['tokens_large_per_q']:.1f} | "
                     f"{row['gflops_per_q']:.1f} | {row['wall_s_per_q']:.2f} |")
    if summary.get("curve"):
        lines += ["", "Accuracy (abstain = wrong) against N:", "",
                  "| N | " + " | ".join(summary["curve"]) + " |", "|---" * (len(summary["curve"]) + 1) + "|"]
        for k in range(summary["n"]):
            lines.append(f"| {k + 1} | " + " | ".join(f"{v[k]:.3f}" for v in summary["curve"].values()) + " |")
    return "\n".join(lines) + "\n"


def plot_curve(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_cov) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    ns = list(range(1, summary["n"] + 1))
    for name, values in summary["curve"].items():
        ax.plot(ns, values, marker="o", label=f"{name} (small x N)" if name != "cascade" else "cascade")
    table = {row["strategy"]: row for row in summary["table"]}
    for name, style, color in (("small-greedy", ":", "tab:gray"), ("large-greedy", "--", "black"),
                               ("large-verified", "-.", "tab:purple")):
        ax.axhline(table[name]["accuracy"], linestyle=style, color=color, label=name)
    ax.set_xlabel("N (samples from the small model)")
    ax.set_ylabel("accuracy (abstentions wrong)")
    ax.set_xticks(ns)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{summary['asked']} questions, task {summary['settings'].get('task')}")
    for name, values in summary.get("curve_verified", {}).items():
        ax_cov.plot(ns, values, marker=".", label=name)
    ax_cov.set_xlabel("N")
    ax_cov.set_ylabel("share")
    ax_cov.set_xticks(ns)
    ax_cov.set_ylim(0, 1.05)
    ax_cov.grid(alpha=0.3)
    ax_cov.legend(fontsize=8)
    ax_cov.set_title("small x N verified: coverage, precision")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(records: list[dict], settings: dict, out: Path) -> dict:
    summary = summarize(records, settings)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "report.md").write_text(report_markdown(summary))
    if summary["table"]:
        plot_curve(summary, out / "accuracy_vs_n.png")
    return summary
