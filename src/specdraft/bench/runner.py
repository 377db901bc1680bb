"""`specdraft bench`: every method on every prompt of a suite, interleaved, with records one can recompute from.

Measurement protocol:
- the models are loaded once; every method is built from them (methods.py registry);
- warm-up: each method generates `warmup_tokens` on the first prompt before anything is timed;
- all methods run on a prompt before the next prompt, in an order that rotates by one per prompt, so slow
  drift of the machine (thermal, other load) spreads over all methods;
- a multi-turn prompt is a conversation: each method's own answer to turn i is fed back before turn i + 1;
- wall time covers the whole generation call (tokenization excluded, prefill included).

Writes into --out: records.jsonl (one record per prompt, turn and method, written as each prompt completes),
run.json (the run's settings and one entry per part of it), summary.json and report.md with PNG figures
(report.py). `--resume` continues an interrupted run from its whole prompts (hours-long suites run in parts).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..api import load_draft
from ..config import SpecConfig
from ..engine import Engine
from ..errors import SpecdraftError
from ..jsonl import rewrite_jsonl
from ..models.adapter import LoadedModel, load_model, set_threads, weight_bytes
from ..models.native.kernels import startup_info as kernel_startup_info
from ..registry import DRAFTERS, resolve_method
from .methods import HF_AUTO_GAMMA, BenchModels, GenerateTurn, Method, TurnOutput, get_method
from .options import BenchSettings, parse_method
from .report import compare_tokens, read_records
from .suite import DEFAULT_PROMPTS, load_prompts


@dataclass
class Variant:
    """One column of the results: a method at one gamma."""

    label: str
    method: Method
    gamma: int | None
    generate: GenerateTurn


def drafter_settings(settings: BenchSettings) -> dict:
    """The run-wide drafter settings (registry.py) as SpecConfig keyword arguments."""
    return settings.drafter_settings()


def check_methods(settings: BenchSettings) -> list[tuple[str, Method, dict]]:
    """(label, method, its own SpecConfig overrides) per --methods entry, validated before any model loads."""
    methods = []
    for text in settings.methods:
        name, overrides = parse_method(text)
        methods.append((text, get_method(name), overrides))
    if any(m.needs_draft for _, m, _ in methods) and not settings.draft:
        raise SpecdraftError(f"methods {', '.join(m.name for _, m, _ in methods if m.needs_draft)} need --draft")
    for gamma in settings.gammas:
        for _, method, overrides in methods:
            variant_spec(settings, method, gamma, overrides)  # validates
    config = settings.model_config()
    for method in dict.fromkeys(m for _, m, _ in methods):  # e.g. an outside program that is not built
        if method.preflight is not None:
            method.preflight(config)
    return methods


def variant_spec(settings: BenchSettings, method: Method, gamma: int | None, overrides: dict) -> SpecConfig:
    """The run-wide drafter settings with the method's own. A run-wide --lookup-first applies to the methods that
    have a drafter to put prompt lookup in front of; the others keep their auto value (off). Gamma auto on a
    transformers method is transformers' own default length (it has no per-pass choice), the method's own
    (`auto_gamma`) where it says."""
    ours = resolve_method(method.name)
    fields = dict(method=method.name if ours else "draft", gamma=gamma, **drafter_settings(settings))
    if ours and not DRAFTERS[ours[0]].lookup_first:
        fields["lookup_first"] = None
    overrides = dict(overrides)
    options = {**dict(fields.pop("options", ())), **overrides.pop("options", {})}
    fields.update(overrides)
    fields["options"] = options
    if not ours and fields["gamma"] is None:
        fields["gamma"] = method.auto_gamma if method.auto_gamma is not None else HF_AUTO_GAMMA
    return SpecConfig(**fields)


def plan_variants(settings: BenchSettings) -> list[tuple[str, Method, int | None, SpecConfig]]:
    """(label, method, gamma, drafter config) per results column, without loading a model: one column per
    --methods entry, or one per gamma when --gamma sweeps and the method takes it."""
    sweep = len(settings.gammas) > 1
    plan = []
    for text, method, overrides in check_methods(settings):
        swept = method.uses_gamma and "gamma" not in overrides
        for gamma in settings.gammas if swept else settings.gammas[:1]:
            spec = variant_spec(settings, method, gamma, overrides)
            label = f"{text}-g{'auto' if gamma is None else gamma}" if sweep and swept else text
            plan.append((label, method, spec.gamma if method.uses_gamma else None, spec))
    return plan


def build_variants(settings: BenchSettings, models: BenchModels) -> list[Variant]:
    variants: list[Variant] = []
    try:
        for label, method, gamma, spec in plan_variants(settings):
            variants.append(Variant(label, method, gamma, method.build(models, spec)))
    except BaseException:
        close_variants(variants)  # a server one of them started must not outlive a failed build
        raise
    return variants


def close_variants(variants: list[Variant]) -> None:
    """Stop what the variants hold (a method's generate function may have a `close`, e.g. a peer's server)."""
    for variant in variants:
        close = getattr(variant.generate, "close", None)
        if close is not None:
            close()


class Conversation:
    """Builds the prompt ids of each turn: chat template over the message history, or (raw mode) the previous
    prompt and answer ids followed by the new turn's ids."""

    def __init__(self, target: LoadedModel, chat: bool):
        self.encoder = Engine(target)
        self.tokenizer = target.tokenizer
        self.chat = chat
        self.messages: list[dict] = []
        self.ids: list[int] = []

    def prompt_ids(self, user_text: str) -> list[int]:
        if self.chat:
            self.messages.append({"role": "user", "content": user_text})
            return self.encoder.encode_messages(self.messages)
        new = self.tokenizer(user_text, add_special_tokens=not self.ids)["input_ids"]
        return self.ids + list(new)

    def answered(self, prompt_ids: list[int], output: TurnOutput) -> None:
        if self.chat:
            self.messages.append({"role": "assistant", "content": output.text})
        self.ids = prompt_ids + output.token_ids


def make_record(prompt: dict, turn: int, variant: Variant, prompt_ids: list[int], output: TurnOutput) -> dict:
    stats = output.stats or {}
    new_tokens = len(output.token_ids)
    return {
        "question_id": prompt["question_id"], "category": prompt["category"], "turn": turn,
        "method": variant.method.name, "label": variant.label, "gamma": variant.gamma,
        "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "wall_s": output.wall_s,
        "tokens_per_s": new_tokens / output.wall_s if output.wall_s > 0 else 0.0,
        # the loop's own counters (None for methods without them, e.g. transformers' generate)
        "target_passes": stats.get("target_passes"), "drafted": stats.get("drafted"),
        "accepted": stats.get("accepted"), "examined": stats.get("examined"),
        "accepted_per_position": stats.get("accepted_per_position"),
        "drafted_per_position": stats.get("drafted_per_position"),
        "time_prefill_s": stats.get("time_prefill_s"), "time_draft_s": stats.get("time_draft_s"),
        "time_verify_s": stats.get("time_verify_s"), "finish_reason": stats.get("finish_reason"),
        "identical_to_ar": None, "first_divergence": None,
        # every scalar the loop reports (backend, finish reason, timings, ...; new fields show up without a change)
        # what the drafter reports (its setup; a labelled draft's tallies: which sorted exit drafted, and had
        # accepted, how many) and the per-source acceptance at each draft step of chain passes
        "stats": {k: v for k, v in stats.items()
                  if isinstance(v, (str, int, float, bool)) or k in ("drafter", "steps_by_source")} or None,
        "output_ids": list(output.token_ids), "text": output.text,
    }


def mark_equality(records: list[dict], greedy: bool) -> None:
    """Compare each record with the `ar` record of the same prompt and turn (greedy only: sampled outputs are
    equal in distribution, not token by token)."""
    if not greedy:
        return
    reference = {(r["question_id"], r["turn"]): r["output_ids"] for r in records if r["label"] == "ar"}
    for r in records:
        ref = reference.get((r["question_id"], r["turn"]))
        if ref is not None:
            r["identical_to_ar"], r["first_divergence"] = compare_tokens(r["output_ids"], ref)


def run_prompts(settings: BenchSettings, variants: list[Variant], target: LoadedModel, prompts: list[dict],
                on_prompt_done=None, progress: bool = True, warmup_s: dict | None = None,
                done: frozenset[str] = frozenset()) -> list[dict]:
    """Warm up, then every variant on every prompt (rotating order); returns the new records. `warmup_s`, when
    given, receives each variant's warm-up wall time (a one-off cost, reported apart from the timings). Prompts
    whose question_id is in `done` are skipped (a resumed run); the others keep the rotation of a full run."""
    from tqdm import tqdm

    params = settings.sampling()
    if all(p["question_id"] in done for p in prompts):
        return []
    for variant in variants:  # warm-up: one-off costs (allocations, lazy init) stay out of the timings
        conversation = Conversation(target, settings.chat)
        started = time.perf_counter()
        variant.generate(conversation.prompt_ids(prompts[0]["turns"][0]), settings.sampling(settings.warmup_tokens))
        if warmup_s is not None:
            warmup_s[variant.label] = time.perf_counter() - started
    records: list[dict] = []
    total = sum(len(p["turns"]) for p in prompts if p["question_id"] not in done) * len(variants)
    with tqdm(total=total, unit="turn", desc="bench", file=sys.stderr, disable=not progress,
              dynamic_ncols=True) as bar:
        for index, prompt in enumerate(prompts):
            if prompt["question_id"] in done:
                continue
            shift = index % len(variants)
            prompt_records = []
            for variant in variants[shift:] + variants[:shift]:
                conversation = Conversation(target, settings.chat)
                for turn, user_text in enumerate(prompt["turns"]):
                    prompt_ids = conversation.prompt_ids(user_text)
                    output = variant.generate(prompt_ids, params)
                    conversation.answered(prompt_ids, output)
                    record = make_record(prompt, turn, variant, prompt_ids, output)
                    prompt_records.append(record)
                    bar.set_postfix_str(f"{prompt['question_id']} {variant.label} {record['tokens_per_s']:.2f} tok/s")
                    bar.update(1)
            order = {v.label: i for i, v in enumerate(variants)}
            prompt_records.sort(key=lambda r: (order[r["label"]], r["turn"]))
            mark_equality(prompt_records, params.greedy)
            records += prompt_records
            if on_prompt_done:
                on_prompt_done(prompt_records)
    return records


# ------------------------------------------------------------------------------------------------ resume

# Settings that do not change what a record measures: where files go, which prompts this call selects.
NOT_RUN_IDENTITY = ("out", "command", "resume", "overwrite", "limit", "categories", "cache_dir", "versus")


def run_identity(settings: BenchSettings) -> dict:
    """The settings a resumed run must share with the run it continues, plus the prompt file's content hash
    (a suite rebuilt between the parts would mix answers to different prompts under one question_id)."""
    prompts_file = Path(settings.prompts) if settings.prompts else DEFAULT_PROMPTS
    identity = {k: v for k, v in asdict(settings).items() if k not in NOT_RUN_IDENTITY and k != "options"}
    identity.update(settings.drafter_values())  # by name, as run files before 2026-12-03 kept them
    identity["prompts_sha256"] = hashlib.sha256(prompts_file.read_bytes()).hexdigest()
    return json.loads(json.dumps(identity))


def run_identity_defaults() -> dict:
    """Every identity setting's default (a setting absent from a run file had its default then)."""
    defaults = BenchSettings()
    flat = {k: v for k, v in asdict(defaults).items() if k != "options"}
    return json.loads(json.dumps({**flat, **defaults.drafter_values()}))


def _flat_settings(stored: dict) -> dict:
    """A run file's settings with the drafter settings by name (older files also kept outside drafters' settings
    in "options", as pairs)."""
    return {**{k: v for k, v in stored.items() if k != "options"}, **dict(stored.get("options", []))}


def complete_records(records: list[dict], prompts: list[dict], labels: list[str]) -> tuple[list[dict], set[str]]:
    """(records to keep, question_ids done): a selected prompt counts as done when every label has every turn;
    a prompt with only part of them (cut off midway) is dropped so that it runs again whole. Records of prompts
    outside this call's selection are kept as they are."""
    turns = {p["question_id"]: len(p["turns"]) for p in prompts}
    seen: dict[str, set] = {}
    for r in records:
        seen.setdefault(r["question_id"], set()).add((r["label"], r["turn"]))
    done = {qid for qid, n in turns.items()
            if seen.get(qid, set()) >= {(label, t) for label in labels for t in range(n)}}
    kept = [r for r in records if r["question_id"] in done or r["question_id"] not in turns]
    return kept, done


# settings whose default changed after they were added: what a run made before the setting existed used
# off until the auto default (2026-11-30); the draft model read the whole prompt until 2026-12-03
RAN_BEFORE_SETTING = {"lookup_first": 0, "draft_context": 0}


def open_run(settings: BenchSettings, prompts: list[dict], labels: list[str]) -> tuple[list[dict], set[str], dict]:
    """(records kept from an earlier run, question_ids done, the run file's content) for --out. Refuses to
    overwrite records silently, and to resume a run made with other settings; both before any model loads."""
    out = Path(settings.out)
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out {out} is a file; name a folder (it is created if missing)")
    records_path, run_path = out / "records.jsonl", out / "run.json"
    has_records = records_path.exists() and records_path.stat().st_size > 0
    identity = run_identity(settings)
    fresh = {"settings": identity, "segments": []}
    if settings.overwrite or not (has_records or settings.resume):
        return [], set(), fresh
    if not settings.resume:
        raise SpecdraftError(f"{records_path} holds records of an earlier run: pass --resume to continue it, "
                             "--overwrite to replace it, or another --out")
    if not has_records:  # nothing to continue: a fresh run under this call's settings
        return [], set(), fresh
    if not run_path.exists():
        raise SpecdraftError(f"{out} has records but no run.json (written by an older specdraft, or edited): "
                             "its settings cannot be checked; use --overwrite or another --out")
    try:
        run = json.loads(run_path.read_text(encoding="utf-8"))
        problem = "" if isinstance(run, dict) and isinstance(run.get("settings"), dict) and isinstance(
            run.get("segments", []), list) else "no settings in it"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = str(error)
    if problem:
        raise SpecdraftError(f"cannot resume {out}: its run.json is not a run file of specdraft bench ({problem}); "
                             "use --overwrite or another --out")
    run.setdefault("segments", [])
    # a setting added to specdraft after that run began is absent from its file; the run used the behaviour
    # from before the setting: its default, or the value in RAN_BEFORE_SETTING where the default changed later
    defaults = {**run_identity_defaults(), **RAN_BEFORE_SETTING}
    stored = _flat_settings(run["settings"])
    then = {**{k: defaults[k] for k in identity.keys() - stored.keys() if k in defaults}, **stored}
    changed = sorted(k for k in identity.keys() | then.keys() if identity.get(k) != then.get(k))
    if changed:
        details = ", ".join(f"{k}: {then.get(k)!r} then, {identity.get(k)!r} now" for k in changed)
        raise SpecdraftError(f"cannot resume {out}: the run there had other settings ({details}); use the same "
                             "ones, --overwrite, or another --out")
    kept, done = complete_records(read_records(records_path), prompts, labels)
    return kept, done, run


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------------ memory

def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_info(models: BenchModels, variants: list[Variant], records: list[dict]) -> dict:
    longest = max(records, key=lambda r: r["prompt_tokens"] + r["new_tokens"])
    n_tokens = longest["prompt_tokens"] + longest["new_tokens"]
    info = {"target_weight_bytes": models.target.weight_bytes,
            "longest_turn": {"question_id": longest["question_id"], "turn": longest["turn"], "tokens": n_tokens},
            "target_kv_bytes_longest_turn": models.target.kv_bytes(n_tokens),
            "peak_rss_bytes": peak_rss_bytes()}
    if models.draft is not None and any(v.method.needs_draft for v in variants):
        info["draft_weight_bytes"] = models.draft.weight_bytes
        info["draft_kv_bytes_longest_turn"] = models.draft.kv_bytes(n_tokens)
    return info


# ------------------------------------------------------------------------------------------------ run info

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def model_info(loaded: LoadedModel) -> dict:
    """What the loaded model says about itself: its plain fields and properties (a backend that adds some shows
    up here without a change to the benchmark)."""
    names = list(vars(loaded)) + [n for n, v in vars(type(loaded)).items() if isinstance(v, property)]
    info = {}
    for name in names:
        value = getattr(loaded, name, None)
        if isinstance(value, (str, int, float, bool)) and not name.startswith("_"):
            info[name] = value
    architecture = (getattr(loaded.config, "architectures", None) or ["unknown"])[0]
    info.update(dtype=loaded.dtype_name,
                model_class=type(loaded.model).__name__ if loaded.model is not None else architecture)
    return info


def run_info(settings: BenchSettings, models: BenchModels) -> dict:
    import transformers

    return {
        # the dtype the target was loaded in (auto gives the native backend bf16 weights, see load_model)
        "settings": {**asdict(settings), "dtype_resolved": models.target.dtype_name},
        "date": _now(),
        "machine": {"cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)),
                    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "platform": platform.platform(), "load_average_at_start": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "target": model_info(models.target),
        "draft": model_info(models.draft) if models.draft is not None else None,
    }


def run_bench(settings: BenchSettings, progress: bool = True, models: BenchModels | None = None) -> dict:
    """Run the benchmark described by `settings`; write records, summary and report into settings.out."""
    from .report import check_versus

    prompts = load_prompts(settings.prompts, list(settings.categories) or None, settings.limit)
    plan = plan_variants(settings)  # fail before loading gigabytes
    labels = [label for label, *_ in plan]
    check_versus(settings.versus, labels)  # before loading gigabytes
    # their checks too, before open_run: --overwrite must not empty a run for a typo
    settings.sampling()
    settings.model_config()
    out = Path(settings.out)
    kept, done, run = open_run(settings, prompts, labels)
    startup: dict = {}  # one-off costs, paid once per process and kept out of every timing
    if models is None:
        set_threads(settings.threads)
        config = settings.model_config()
        started = time.perf_counter()
        target = load_model(config.target, config.dtype, config.cache_dir, progress, config.backend)
        startup["target_load_s"] = time.perf_counter() - started
        needs_draft = any(method.needs_draft for _, method, _, _ in plan)
        started = time.perf_counter()
        draft = load_draft(config, target, progress) if needs_draft else None
        if draft is not None:
            startup["draft_load_s"] = time.perf_counter() - started
        models = BenchModels(config, target, draft)
    startup["native_kernels"] = kernel_startup_info()
    variants = build_variants(settings, models)
    try:
        return _run_variants(settings, progress, models, variants, prompts, kept, done, run, startup)
    finally:
        close_variants(variants)


def _run_variants(settings: BenchSettings, progress: bool, models: BenchModels, variants: list[Variant],
                  prompts: list[dict], kept: list[dict], done: set[str], run: dict, startup: dict) -> dict:
    from .report import summarize, write_report

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    info = run_info(settings, models)
    # one segment per call: a resumed run says when each part ran and how loaded the machine was
    segment = {"started": info["date"], "load_average_at_start": os.getloadavg(), "prompts_run": 0}
    run["segments"].append(segment)

    def save_run() -> None:
        (out / "run.json.tmp").write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(out / "run.json.tmp", out / "run.json")

    rewrite_jsonl(out / "records.jsonl", kept)  # an interrupted prompt's records are gone
    save_run()
    with open(out / "records.jsonl", "a", encoding="utf-8") as sink:
        def write(prompt_records: list[dict]) -> None:
            for r in prompt_records:
                sink.write(json.dumps(r, ensure_ascii=False) + "\n")
            sink.flush()
            segment.update(prompts_run=segment["prompts_run"] + 1, last_prompt_done=_now(),
                           load_average_at_end=os.getloadavg())
            save_run()

        startup["warmup_s"] = {}
        new = run_prompts(settings, variants, models.target, prompts, write, progress, startup["warmup_s"],
                          frozenset(done))
    records = kept + new
    if not records:
        raise SpecdraftError(f"no records in {out}: the prompt selection is empty")
    info["date"] = run["segments"][0]["started"]
    info["segments"] = run["segments"]
    info["startup"] = startup
    info["memory"] = memory_info(models, variants, records)
    info["machine"]["load_average_at_end"] = os.getloadavg()  # other processes distort timings: say so
    summary = summarize(records, info, settings.versus)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    write_report(summary, records, out)
    return summary


def cmd_bench(args, argv: list[str]) -> int:
    import shlex

    from .options import settings_from_args

    settings = settings_from_args(args, command="specdraft " + shlex.join(argv))
    summary = run_bench(settings)
    from .report import format_table

    print(format_table(summary))
    print(f"records, summary.json and report.md in {settings.out}", file=sys.stderr)
    return 0


__all__ = ["run_bench", "cmd_bench", "compare_tokens", "mark_equality", "weight_bytes",
           "build_variants", "close_variants", "Variant"]
