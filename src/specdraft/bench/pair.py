"""Side-by-side timing on the packaged pair: our AR and speculative paths against transformers' `generate`
with and without `assistant_model`, interleaved per prompt (rotating order) so machine drift cancels.

    python -m specdraft.bench.pair --dtypes float32,bfloat16 --gammas 2,3,4,6 --max-new-tokens 64 --out docs/bench

Writes records.jsonl (one record per run) and summary.md (a table per dtype) under --out; prints the summary.
Greedy decoding throughout, so every method's text can be checked against our autoregressive output.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ..config import SamplingParams, SpecConfig
from ..drafters import build_drafter
from ..engine import Engine
from ..models.adapter import load_model, set_threads
from ..models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "summary": ("Summarize in two sentences: The city council voted on Tuesday to expand the bike lane network by "
                "40 kilometres over the next three years. Supporters said the plan would cut traffic and "
                "emissions, while some shop owners worried about losing parking spaces in the city centre."),
    "chat": "What is the difference between a list and a tuple in Python? Answer briefly.",
    "translation": "Translate to English: Der Zug nach Berlin hat heute wegen eines Sturms zwei Stunden Verspätung.",
}


def run_ours(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> dict:
    start = time.perf_counter()
    result = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens))
    wall = time.perf_counter() - start
    s = result.stats
    return {"tokens": result.token_ids, "wall_s": wall, "passes": s.target_passes, "tau": s.tau,
            "acceptance": s.acceptance_rate, "alpha": s.alpha, "predicted_tau": s.predicted_tau,
            "draft_s": s.time_draft_s, "verify_s": s.time_verify_s}


def run_hf(target, prompt_ids: list[int], max_new_tokens: int, assistant=None) -> dict:
    input_ids = torch.tensor([prompt_ids])
    kwargs = {"assistant_model": assistant.model} if assistant is not None else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, pad_token_id=target.tokenizer.eos_token_id,
                                    **kwargs)
    wall = time.perf_counter() - start
    tokens = out[0, len(prompt_ids):].tolist()
    eos = target.eos_token_ids
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]
    return {"tokens": tokens, "wall_s": wall}


def bench_dtype(dtype: str, gammas: list[str], max_new_tokens: int, prompts: dict[str, str], records: list,
                meta: dict) -> None:
    target = load_model(meta["target"], dtype, progress=False)
    draft = load_model(meta["draft"], dtype, progress=False)
    ar = Engine(target)
    spec_engines = {}
    for gamma_spec in gammas:  # "4" or "8c0.4": gamma 8, stop drafting below top-1 probability 0.4
        gamma, _, confidence = gamma_spec.partition("c")
        spec = SpecConfig("draft", int(gamma), draft_confidence=float(confidence or 0))
        spec_engines[gamma_spec] = Engine(target, build_drafter(spec, target, draft), spec)
    methods = {"ar": lambda ids: run_ours(ar, ids, max_new_tokens),
               "hf-ar": lambda ids: run_hf(target, ids, max_new_tokens),
               "hf-assisted": lambda ids: run_hf(target, ids, max_new_tokens, draft)}
    for g, engine in spec_engines.items():
        methods[f"draft-g{g}"] = lambda ids, engine=engine: run_ours(engine, ids, max_new_tokens)
    warm_ids = ar.encode("Say hi.")  # warm-up: first calls pay one-off costs
    for engine in [ar, *spec_engines.values()]:
        engine.generate(warm_ids, SamplingParams(max_new_tokens=4))
    run_hf(target, warm_ids, 4)
    run_hf(target, warm_ids, 4, draft)
    names = list(methods)
    for i, (category, text) in enumerate(prompts.items()):
        ids = ar.encode(text)
        order = names[i % len(names):] + names[: i % len(names)]  # rotate so no method always runs first
        results = {}
        for name in order:
            results[name] = methods[name](ids)
            r = results[name]
            print(f"  [{dtype}] {category:12s} {name:12s} {len(r['tokens']):4d} tok {r['wall_s']:7.2f}s "
                  f"{len(r['tokens']) / r['wall_s']:6.2f} tok/s", file=sys.stderr, flush=True)
        for name, r in results.items():
            records.append({**meta, "dtype": dtype, "category": category, "method": name,
                            "new_tokens": len(r["tokens"]), "tokens_per_s": len(r["tokens"]) / r["wall_s"],
                            "identical_to_ar": r["tokens"] == results["ar"]["tokens"],
                            **{k: v for k, v in r.items() if k != "tokens"}})


def summarize(records: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['machine']}, torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {meta['threads']} threads; target {meta['target']}, draft {meta['draft']} "
             f"(Q4 GGUF weights dequantized); greedy, {meta['max_new_tokens']} new tokens, chat template.",
             f"Command: `{meta['command']}`", ""]
    for dtype in dict.fromkeys(r["dtype"] for r in records):
        rows = [r for r in records if r["dtype"] == dtype]
        base = {r["category"]: r["tokens_per_s"] for r in rows if r["method"] == "hf-ar"}
        lines += [f"### {dtype}", "", "| method | " + " | ".join(dict.fromkeys(r["category"] for r in rows)) +
                  " | mean tok/s | speedup vs hf-ar | τ | acceptance | identical to ar |",
                  "|---" * (len(base) + 6) + "|"]
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            cells = [f"{r['tokens_per_s']:.2f}" for r in mine]
            mean = sum(r["tokens_per_s"] for r in mine) / len(mine)
            speedup = sum(r["tokens_per_s"] / base[r["category"]] for r in mine) / len(mine)
            taus = [r["tau"] for r in mine if "tau" in r]
            accs = [r["acceptance"] for r in mine if "acceptance" in r and r["method"] != "ar"]
            tau = f"{sum(taus) / len(taus):.2f}" if taus else "-"
            acc = f"{sum(accs) / len(accs):.2f}" if accs else "-"
            same = sum(r["identical_to_ar"] for r in mine)
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean:.2f} | {speedup:.2f}x | {tau} | {acc} | "
                         f"{same}/{len(mine)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--gammas", default="3,4,8c0.4", help="comma list; 8c0.4 = gamma 8, stop drafting when "
                        "the draft's top-1 probability < 0.4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="categories to run")
    parser.add_argument("--out", default="docs/bench")
    args = parser.parse_args(argv)
    set_threads(None)
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
            f"{_cpu_model()}, {torch.backends.cpu.get_cpu_capability()}", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(),
            "target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
            "command": "python -m specdraft.bench.pair " + " ".join(argv if argv is not None else sys.argv[1:])}
    prompts = {k: PROMPTS[k] for k in args.prompts.split(",")}
    records: list[dict] = []
    for dtype in args.dtypes.split(","):
        bench_dtype(dtype, args.gammas.split(","), args.max_new_tokens, prompts, records, meta)
        gc.collect()  # this dtype's models are out of scope: free them before loading the next
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    summary = summarize(records, meta)
    (out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
