"""The benchmark runner on tiny random models: records complete, summary recomputable, equality checks that fail."""

from __future__ import annotations

import copy
import json

import pytest

from specdraft.bench import methods as bench_methods
from specdraft.bench.methods import BenchModels, Method
from specdraft.bench.options import BenchSettings
from specdraft.bench.report import format_report, summarize
from specdraft.bench.runner import build_variants, compare_tokens, mark_equality, run_bench
from specdraft.bench.suite import load_prompts
from specdraft.config import ModelConfig
from specdraft.errors import SpecdraftError

METHODS = ("ar", "hf-ar", "hf-assisted", "hf-prompt-lookup", "draft", "prompt-lookup")
PROMPTS = [
    {"question_id": "chat-1", "category": "chat", "turns": ["ab cd ef", "ga hb"]},
    {"question_id": "chat-2", "category": "chat", "turns": ["bad cab"]},
    {"question_id": "code-1", "category": "code", "turns": ["abc abc abc ab"]},
    {"question_id": "code-2", "category": "code", "turns": ["jig fig. dig"]},
]


@pytest.fixture(scope="module")
def bench_run(tiny_models, tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    settings = BenchSettings(prompts=str(prompts), methods=METHODS, target=str(tiny_dirs["target"]),
                             draft=str(tiny_dirs["draft"]), gammas=(2, 4), max_new_tokens=12, dtype="float32",
                             out=str(root / "out"), chat=False, warmup_tokens=2, command="test")
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    summary = run_bench(settings, progress=False, models=models)
    records = [json.loads(line) for line in (root / "out" / "records.jsonl").read_text().splitlines()]
    return settings, summary, records, root / "out"


def test_records_cover_every_prompt_turn_and_method_once(bench_run):
    records = bench_run[2]
    labels = ["ar", "hf-ar", "hf-assisted", "hf-prompt-lookup-g2", "hf-prompt-lookup-g4", "draft-g2", "draft-g4",
              "prompt-lookup-g2", "prompt-lookup-g4"]
    expected = {(p["question_id"], t, label) for p in PROMPTS for t in range(len(p["turns"])) for label in labels}
    keys = [(r["question_id"], r["turn"], r["label"]) for r in records]
    assert sorted(keys) == sorted(expected)


def test_records_hold_tokens_time_passes_and_text(bench_run):
    _, _, records, _ = bench_run
    for r in records:
        assert r["new_tokens"] == len(r["output_ids"]) and 0 < r["new_tokens"] <= 12 or r["new_tokens"] == 0
        assert r["wall_s"] > 0 and isinstance(r["text"], str)
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
        ours = not r["method"].startswith("hf-")
        assert (r["target_passes"] is not None) == ours
        assert (r["stats"] is not None) == ours
        if ours:
            assert r["stats"]["backend"] in ("native", "transformers")
        if ours and r["method"] != "ar":
            assert len(r["accepted_per_position"]) <= r["gamma"] and r["accepted"] <= r["drafted"]


def test_second_turn_prompt_holds_the_first_turn_answer(bench_run, tiny_models):
    _, _, records, _ = bench_run
    tokenizer = tiny_models["target"].tokenizer
    second_turn_ids = tokenizer(PROMPTS[0]["turns"][1], add_special_tokens=False)["input_ids"]
    for label in {r["label"] for r in records}:
        first, second = (next(r for r in records if r["label"] == label and r["question_id"] == "chat-1"
                              and r["turn"] == t) for t in (0, 1))
        assert second["prompt_tokens"] == first["prompt_tokens"] + first["new_tokens"] + len(second_turn_ids)


def test_summary_numbers_follow_from_records(bench_run):
    _, summary, records, _ = bench_run
    assert summary["baseline"] == "hf-ar"
    for label, groups in summary["results"].items():
        for category in ("chat", "code", "overall"):
            mine = [r for r in records if r["label"] == label and category in ("overall", r["category"])]
            base = [r for r in records if r["label"] == "hf-ar" and category in ("overall", r["category"])]

            def speed(rows):
                ids = sorted({r["question_id"] for r in rows})
                return sum(sum(r["new_tokens"] for r in rows if r["question_id"] == q)
                           / sum(r["wall_s"] for r in rows if r["question_id"] == q) for q in ids) / len(ids)

            stats = groups[category]
            assert stats["tokens_per_s"] == pytest.approx(speed(mine))
            assert stats["speedup"] == pytest.approx(speed(mine) / speed(base))
            assert stats["new_tokens"] == sum(r["new_tokens"] for r in mine)
            assert stats["identical_to_ar"] == pytest.approx(sum(r["identical_to_ar"] for r in mine) / len(mine))
            if mine[0]["target_passes"] is not None:
                passes = sum(r["target_passes"] for r in mine)
                accepted = sum(r["accepted"] for r in mine)
                assert stats["mean_accepted"] == pytest.approx((accepted + passes) / passes)
                if label != "ar":
                    assert stats["acceptance_rate"] == pytest.approx(accepted / sum(r["drafted"] for r in mine))
            else:
                assert stats["mean_accepted"] is None
            # decode-only speed: our loop times its prefill; transformers' methods have none to leave out
            if mine[0]["time_prefill_s"] is not None:
                ours = [dict(r, wall_s=r["wall_s"] - r["time_prefill_s"]) for r in mine]
                ar = [dict(r, wall_s=r["wall_s"] - r["time_prefill_s"]) for r in records
                      if r["label"] == "ar" and category in ("overall", r["category"])]
                assert stats["decode_tokens_per_s"] == pytest.approx(speed(ours))
                assert stats["decode_speedup"] == pytest.approx(speed(ours) / speed(ar))
                assert stats["decode_tokens_per_s"] > stats["tokens_per_s"]
            else:
                assert stats["decode_tokens_per_s"] is None and stats["decode_speedup"] is None


def test_greedy_fp32_outputs_equal_ar_for_every_method(bench_run):
    _, summary, records, _ = bench_run
    assert all(r["identical_to_ar"] is True for r in records)
    assert all(g["overall"]["identical_to_ar"] == 1.0 for g in summary["results"].values())


def test_report_and_figures_are_written(bench_run):
    _, summary, _, out = bench_run
    for name in ("summary.json", "report.md", "speedup_by_category.png", "tau_vs_alpha.png", "gamma_sweep.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| draft-g4 |" in report and "Command: `test`" in report
    assert "This run has 2 prompts in its smallest category" in report  # the fixture has 2 per category
    for label, groups in summary["results"].items():
        overall = groups["overall"]
        if label == summary["baseline"]:
            assert overall["speedup_interval"] is None
        else:  # every method ran every prompt here, so the point lies inside its own interval
            low, high = overall["speedup_interval"]
            assert low < overall["speedup"] < high
    assert summary["memory"]["target_weight_bytes"] > 0 and summary["memory"]["draft_kv_bytes_longest_turn"] > 0


def test_start_up_costs_are_reported_apart_from_the_timings(bench_run):
    _, summary, records, out = bench_run
    startup = summary["startup"]
    assert set(startup["warmup_s"]) == {r["label"] for r in records}  # every method warmed up once
    assert all(seconds > 0 for seconds in startup["warmup_s"].values())
    assert startup["native_kernels"]["kernels"] in ("built", "imported", "unavailable", "not loaded")
    assert "## Start-up (once per process, outside every timing)" in (out / "report.md").read_text()


def test_compare_tokens_flags_a_different_token():
    assert compare_tokens([5, 6, 7], [5, 6, 7]) == (True, None)
    assert compare_tokens([5, 9, 7], [5, 6, 7]) == (False, 1)


def test_compare_tokens_flags_a_shorter_or_longer_output():
    assert compare_tokens([5, 6], [5, 6, 7]) == (False, 2)
    assert compare_tokens([5, 6, 7, 8], [5, 6, 7]) == (False, 3)
    assert compare_tokens([], [5]) == (False, 0)


def test_equality_check_flags_doctored_records_and_summary_counts_them(bench_run):
    _, summary, records, _ = bench_run
    doctored = copy.deepcopy(records)
    changed = next(r for r in doctored if r["label"] == "draft-g2" and r["new_tokens"] >= 3)
    changed["output_ids"][2] = changed["output_ids"][2] + 1  # a different token at position 2
    shortened = next(r for r in doctored if r["label"] == "hf-assisted" and r["new_tokens"] >= 2)
    shortened["output_ids"] = shortened["output_ids"][:-1]  # a prefix of ar's output: same tokens, shorter
    mark_equality(doctored, greedy=True)
    assert (changed["identical_to_ar"], changed["first_divergence"]) == (False, 2)
    assert (shortened["identical_to_ar"], shortened["first_divergence"]) == (False, shortened["new_tokens"] - 1)
    info = {k: v for k, v in summary.items() if k not in ("baseline", "categories", "methods", "results")}
    redone = summarize(doctored, info)
    for label in ("draft-g2", "hf-assisted"):
        overall = redone["results"][label]["overall"]
        assert overall["identical_to_ar"] == pytest.approx((overall["turns"] - 1) / overall["turns"])
        assert len(overall["first_divergence"]) == 1
    report = format_report(redone, [])
    assert "draft-g2: outputs of our own loop that differ from `ar` are not expected" in report
    assert "different forward implementation" in report  # hf-assisted diverged too, flagged as such


def test_sampling_runs_skip_the_equality_check(bench_run):
    _, _, records, _ = bench_run
    doctored = copy.deepcopy(records)
    for r in doctored:
        r["identical_to_ar"] = None
    mark_equality(doctored, greedy=False)
    assert all(r["identical_to_ar"] is None for r in doctored)


def test_a_registered_method_joins_without_touching_the_runner(tiny_models, monkeypatch):
    ar = bench_methods.get_method("ar")
    monkeypatch.setitem(bench_methods.METHODS, "my-drafter",
                        Method("my-drafter", "test", ar.build, uses_gamma=True))
    settings = BenchSettings(methods=("ar", "my-drafter"), gammas=(2, 3), target="t", draft=None)
    models = BenchModels(ModelConfig(target="t", draft=None), tiny_models["target"], None)
    assert [v.label for v in build_variants(settings, models)] == ["ar", "my-drafter-g2", "my-drafter-g3"]


def test_unknown_method_and_missing_draft_are_user_errors(tiny_models):
    models = BenchModels(ModelConfig(target="t", draft=None), tiny_models["target"], None)
    with pytest.raises(SpecdraftError, match="unknown benchmark method"):
        build_variants(BenchSettings(methods=("nope",)), models)
    with pytest.raises(SpecdraftError, match="need --draft"):
        build_variants(BenchSettings(methods=("draft",), draft=None), models)


def test_prompt_file_filters_and_rejects_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    assert [p["question_id"] for p in load_prompts(path, ["code"], 1)] == ["code-1"]
    assert [p["question_id"] for p in load_prompts(path, None, 1)] == ["chat-1", "code-1"]
    with pytest.raises(SpecdraftError, match="no prompts in category"):
        load_prompts(path, ["math"])
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": []}) + "\n")
    with pytest.raises(SpecdraftError, match="turns"):
        load_prompts(path)


def test_committed_suite_has_seven_categories_of_twenty():
    prompts = load_prompts()
    counts = {c: sum(p["category"] == c for p in prompts) for c in {p["category"] for p in prompts}}
    assert counts == {c: 20 for c in ("multi_turn", "translation", "summarization", "qa", "math", "rag", "code")}
    assert all(len(p["turns"]) == 2 for p in prompts if p["category"] == "multi_turn")


def test_cli_bench_reports_an_unknown_method_without_traceback(capsys):
    from specdraft.cli import main

    assert main(["bench", "--methods", "ar,nope"]) == 2
    assert "unknown benchmark method 'nope'" in capsys.readouterr().err


def test_sampling_run_records_no_equality_verdict(tiny_models, tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[2]) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "hf-ar", "draft"), target=str(tiny_dirs["target"]),
                             draft=str(tiny_dirs["draft"]), max_new_tokens=6, dtype="float32", temperature=0.8,
                             seed=3, out=str(tmp_path / "out"), chat=False, warmup_tokens=1)
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    summary = run_bench(settings, progress=False, models=models)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["identical_to_ar"] is None for r in records)
    assert summary["results"]["draft"]["overall"]["identical_to_ar"] is None
    assert "no equality check" in (tmp_path / "out" / "report.md").read_text()


def test_a_method_can_carry_its_own_drafter_settings(tiny_models, tiny_dirs, tmp_path):
    """One interleaved run compares a method with itself under other settings (an A/B without machine drift)."""
    from specdraft.bench.options import parse_method, split_methods

    assert split_methods("ar,draft[gamma=3,draft_vocab=4],sorted[exits=1:2]") == (
        "ar", "draft[gamma=3,draft_vocab=4]", "sorted[exits=1:2]")
    assert parse_method("sorted[sorted_exits=1:2;exit_rule=cost:1.0]") == (
        "sorted", {"options": {"sorted_exits": (1, 2), "exit_rule": "cost:1.0"}})
    for bad, match in (("draft[gama=3]", "not KEY=VALUE"), ("draft[gamma=x]", "gamma takes a draft length or auto"),
                       ("draft[gamma=3", "one pair of brackets")):
        with pytest.raises(SpecdraftError, match=match):
            parse_method(bad)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[2]) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "draft", "draft[gamma=1]"),
                             target=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), gammas=(3,),
                             max_new_tokens=8, dtype="float32", out=str(tmp_path / "out"), chat=False,
                             warmup_tokens=2, command="test")
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    summary = run_bench(settings, progress=False, models=models)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert {r["label"]: r["gamma"] for r in records} == {"ar": None, "draft": 3, "draft[gamma=1]": 1}
    assert all(len(r["accepted_per_position"]) <= 1 for r in records if r["label"] == "draft[gamma=1]")
    assert summary["results"]["draft[gamma=1]"]["overall"]["identical_to_ar"] == 1.0
    with pytest.raises(SpecdraftError, match="gamma must be"):
        run_bench(BenchSettings(**{**settings.__dict__, "methods": ("draft[gamma=0]",)}), progress=False,
                  models=models)


def test_every_drafter_knob_of_the_command_line_reaches_the_bench_and_its_methods():
    """The bench takes the drafter knobs `generate` and `serve` take (a knob missing from BenchSettings was a
    traceback once, since removed with its knob), run-wide and per method."""
    import argparse
    import dataclasses

    from specdraft.bench.options import add_bench_arguments, settings_from_args
    from specdraft.bench.runner import plan_variants
    from specdraft.knobs import drafter_knobs

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--methods", "sorted,sorted[exit_rule=probe:0.9]", "--exit-rule", "cost-probe:2"])
    settings = settings_from_args(args)
    fields = {f.name for f in dataclasses.fields(BenchSettings)}
    assert set(drafter_knobs(args)) <= fields
    rules = {label: spec.setting("exit_rule") for label, _, _, spec in plan_variants(settings)}
    assert rules == {"sorted": "cost-probe:2", "sorted[exit_rule=probe:0.9]": "probe:0.9"}


def test_lookup_first_is_auto_per_method_and_a_run_wide_value_applies_where_there_is_a_drafter():
    from specdraft.bench.runner import plan_variants

    methods = ("ar", "draft", "prompt-lookup", "draft[lookup_first=0]", "eagle-tree[lookup_first=auto]")
    auto = {label: spec.lookup_first_ngram
            for label, _, _, spec in plan_variants(BenchSettings(methods=methods, draft="d", options=(("eagle_head", "h"),)))}
    assert auto == {"ar": 0, "draft": 2, "prompt-lookup": 0, "draft[lookup_first=0]": 0,
                    "eagle-tree[lookup_first=auto]": 2}
    run_wide = {label: spec.lookup_first_ngram for label, _, _, spec in
                plan_variants(BenchSettings(methods=methods, draft="d", options=(("eagle_head", "h"),),
                                            lookup_first=3))}
    assert run_wide == {**auto, "draft": 3}  # ar and prompt-lookup keep theirs; a method's own setting wins
    with pytest.raises(SpecdraftError, match="has none to fall back on"):
        plan_variants(BenchSettings(methods=("prompt-lookup[lookup_first=2]",), draft="d"))
    with pytest.raises(SpecdraftError, match="n-gram length or auto"):
        plan_variants(BenchSettings(methods=("draft[lookup_first=often]",), draft="d"))


def test_per_label_tallies_of_labelled_drafts_reach_the_summary_and_report():
    from specdraft.bench.report import label_section, label_tallies

    records = [{"stats": {"drafter": {"drafted_by": {"exit 8": 3, "exit 24": 2},
                                      "accepted_by": {"exit 8": 1, "exit 24": 2}}}},
               {"stats": {"drafter": {"drafted_by": {"exit 8": 1}, "accepted_by": {}}}}, {"stats": None}]
    tallies = label_tallies(records)
    assert tallies == {"exit 8": {"drafted": 4, "accepted": 1}, "exit 24": {"drafted": 2, "accepted": 2}}
    assert label_tallies([{"stats": {"drafted": 3}}]) is None
    lines = label_section({"results": {"sorted": {"overall": {"by_label": tallies}}, "ar": {"overall": {}}}})
    assert lines[2] == "- sorted: exit 8: 1/4 accepted (0.25); exit 24: 2/2 accepted (1.00)"


def test_per_source_step_tallies_reach_the_summary_and_report():
    from specdraft.bench.report import step_section, step_tallies

    records = [{"stats": {"steps_by_source": {"lookup": {"reached": [4, 3], "kept": [3, 1]},
                                              "drafter": {"reached": [5], "kept": [2]}}}},
               {"stats": {"steps_by_source": {"drafter": {"reached": [2, 1, 1], "kept": [1, 1, 0]}}}}, {"stats": None}]
    tallies = step_tallies(records)
    assert tallies == {"lookup": {"reached": [4, 3], "kept": [3, 1]},
                       "drafter": {"reached": [7, 1, 1], "kept": [3, 1, 0]}}
    assert step_tallies([{"stats": {"drafted": 3}}]) is None
    lines = step_section({"results": {"eagle": {"overall": {"steps_by_source": tallies}}, "ar": {"overall": {}}}})
    assert "| eagle | drafter | 3/7 (0.43) | 1/1 (1.00) | 0/1 (0.00) | - |" in lines
    assert "| eagle | lookup | 3/4 (0.75) | 1/3 (0.33) | - | - |" in lines
    assert step_section({"results": {"ar": {"overall": {}}}}) == []


def test_an_interrupted_run_resumes_where_it_stopped_and_refuses_other_settings(tiny_models, tiny_dirs, tmp_path):
    """A killed run (whole prompts written, one cut off mid-write) continues with --resume: kept records stay as
    they were, the cut-off prompt runs again whole, and the result equals an uninterrupted run's."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "draft"), target=str(tiny_dirs["target"]),
                             draft=str(tiny_dirs["draft"]), gammas=(2,), max_new_tokens=6, dtype="float32",
                             out=str(tmp_path / "out"), chat=False, warmup_tokens=1, command="test",
                             lookup_first=0)  # what a run from before the setting used (checked below)
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    run_bench(settings, progress=False, models=models)
    records_path = tmp_path / "out" / "records.jsonl"
    lines = records_path.read_text().splitlines()
    full = {(r["question_id"], r["turn"], r["label"]): r["output_ids"] for r in map(json.loads, lines)}
    first_prompt = [line for line in lines if json.loads(line)["question_id"] == "chat-1"]
    second_prompt = [line for line in lines if json.loads(line)["question_id"] == "chat-2"]
    # killed while writing chat-2: one of its records written, the next one cut off
    records_path.write_text("\n".join(first_prompt + second_prompt[:1]) + "\n" + second_prompt[1][:25])

    with pytest.raises(SpecdraftError, match="--resume to continue"):
        run_bench(settings, progress=False, models=models)
    other = BenchSettings(**{**settings.__dict__, "resume": True, "max_new_tokens": 7})
    with pytest.raises(SpecdraftError, match="max_new_tokens: 6 then, 7 now"):
        run_bench(other, progress=False, models=models)
    suite = prompts.read_text()
    prompts.write_text(suite.replace("bad cab", "bad cap"))  # the suite was edited between the parts
    with pytest.raises(SpecdraftError, match="prompts_sha256"):
        run_bench(BenchSettings(**{**settings.__dict__, "resume": True}), progress=False, models=models)
    prompts.write_text(suite)
    assert records_path.read_text().endswith(second_prompt[1][:25])  # a refusal changes nothing

    resumed = BenchSettings(**{**settings.__dict__, "resume": True})
    summary = run_bench(resumed, progress=False, models=models)
    lines_after = records_path.read_text().splitlines()
    assert lines_after[:len(first_prompt)] == first_prompt  # kept as written, not rerun
    after = [json.loads(line) for line in lines_after]
    assert sorted((r["question_id"], r["turn"], r["label"]) for r in after) == sorted(full)
    assert {(r["question_id"], r["turn"], r["label"]): r["output_ids"] for r in after} == full
    segments = summary["segments"]
    assert [s["prompts_run"] for s in segments] == [4, 3]  # chat-2 ran again whole
    assert summary["results"]["draft"]["overall"]["identical_to_ar"] == 1.0
    assert "Resumed run, 2 parts" in (tmp_path / "out" / "report.md").read_text()

    run_path = tmp_path / "out" / "run.json"
    run = json.loads(run_path.read_text())
    del run["settings"]["lookup_first"]  # a setting specdraft gained after the run began: "off" is what ran,
    run_path.write_text(json.dumps(run))  # although its default is now auto
    with pytest.raises(SpecdraftError, match="lookup_first: 0 then, 2 now"):
        run_bench(BenchSettings(**{**resumed.__dict__, "lookup_first": 2}), progress=False, models=models)
    with pytest.raises(SpecdraftError, match="lookup_first: 0 then, None now"):
        run_bench(BenchSettings(**{**resumed.__dict__, "lookup_first": None}), progress=False, models=models)
    again = run_bench(resumed, progress=False, models=models)  # nothing left: no generation, same records
    assert records_path.read_text().splitlines() == lines_after and again["segments"][-1]["prompts_run"] == 0
    fresh = run_bench(BenchSettings(**{**settings.__dict__, "overwrite": True}), progress=False, models=models)
    assert [s["prompts_run"] for s in fresh["segments"]] == [4]


def test_cli_bench_refuses_resume_with_overwrite(capsys):
    from specdraft.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_resuming_a_run_without_records_starts_afresh_under_the_new_settings(tiny_models, tiny_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[2]) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar",), target=str(tiny_dirs["target"]),
                             draft=str(tiny_dirs["draft"]), max_new_tokens=4, dtype="float32",
                             out=str(tmp_path / "out"), chat=False, warmup_tokens=1, command="test")
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    run_bench(settings, progress=False, models=models)
    (tmp_path / "out" / "records.jsonl").write_text("")  # killed before its first prompt was written
    summary = run_bench(BenchSettings(**{**settings.__dict__, "max_new_tokens": 5, "resume": True}),
                        progress=False, models=models)
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["settings"]["max_new_tokens"] == 5 and len(run["segments"]) == 1
    assert summary["settings"]["max_new_tokens"] == 5


# ------------------------------------------------------------------------------------------------ intervals

def _speed_records(label: str, speeds: dict[str, float], categories: dict[str, str]) -> list[dict]:
    """One single-turn record per prompt at the given tokens/s (100 tokens each; none in 1 s at speed 0)."""
    return [{"label": label, "question_id": q, "category": categories[q], "new_tokens": 100 if s else 0,
             "wall_s": 100 / s if s else 1.0} for q, s in speeds.items()]


SUITE_SPEEDS = {"multi_turn": 15.0, "translation": 20.0, "summarization": 10.0, "qa": 20.0, "math": 22.0,
                "rag": 6.0, "code": 60.0}  # tokens/s per category, about those of the real suite on the 0.5B


def _heterogeneous_prompts(n_per_category: int = 6, seed: int = 0):
    """Prompts whose speeds differ tenfold between categories and 30 % within one (like the real suite)."""
    import random

    rng = random.Random(seed)
    categories, base = {}, {}
    for c, speed in SUITE_SPEEDS.items():
        for i in range(n_per_category):
            q = f"{c}-{i}"
            categories[q] = c
            base[q] = speed * rng.uniform(0.7, 1.3)
    return categories, base, rng


def test_a_paired_interval_resolves_a_steady_small_gain_that_prompt_spread_would_hide():
    from specdraft.bench.report import paired_speed_ratio

    categories, base, rng = _heterogeneous_prompts()
    # 4 % faster on every prompt, with 1 % timing noise: pairing sees through the tenfold spread between prompts
    faster = {q: s * 1.04 * rng.uniform(0.99, 1.01) for q, s in base.items()}
    low, high = paired_speed_ratio(_speed_records("a", faster, categories),
                                   _speed_records("b", base, categories))["interval"]
    assert 1.02 < low < high < 1.06
    # negative control: the same speeds with the pairing broken (each prompt compared with another prompt of its
    # category) no longer resolve the gain
    shuffled = {}
    for c in SUITE_SPEEDS:
        members = [q for q in faster if categories[q] == c]
        rotated = members[1:] + members[:1]
        shuffled.update({q: faster[r] for q, r in zip(members, rotated)})
    low, high = paired_speed_ratio(_speed_records("a", shuffled, categories),
                                   _speed_records("b", base, categories))["interval"]
    assert low < 1.0 < high


def _coverage(level: float, per_category: int = 6, suites: int = 200) -> float:
    """How often the interval holds the true ratio 1 over simulated suites where both methods run at the same
    speed with 3 % timing noise each."""
    import random

    from specdraft.bench.report import paired_speed_ratio

    rng = random.Random(7)
    held = 0
    for suite in range(suites):
        categories, base, _ = _heterogeneous_prompts(per_category, seed=100 + suite)
        a = {q: s * rng.gauss(1.0, 0.03) for q, s in base.items()}
        b = {q: s * rng.gauss(1.0, 0.03) for q, s in base.items()}
        low, high = paired_speed_ratio(_speed_records("a", a, categories), _speed_records("b", b, categories),
                                       level=level, resamples=1000, seed=suite)["interval"]
        held += low <= 1.0 <= high
    return held / suites


def test_the_interval_holds_the_true_ratio_about_as_often_as_it_claims():
    assert 0.9 <= _coverage(0.95) <= 0.99
    # two prompts per category: the rescaled draws keep it near its level (a plain bootstrap held the truth
    # about 3 times in 4 there)
    assert 0.83 <= _coverage(0.95, per_category=2)
    # negative control: the same check on a 50 % interval fails, so the check can tell
    assert not 0.9 <= _coverage(0.5) <= 0.99


def test_a_real_loss_is_resolved_and_thin_or_partial_data_is_handled():
    from specdraft.bench.report import paired_speed_ratio

    categories, base, rng = _heterogeneous_prompts(seed=1)
    slower = {q: s * 0.9 * rng.uniform(0.97, 1.03) for q, s in base.items()}
    paired = paired_speed_ratio(_speed_records("a", slower, categories), _speed_records("b", base, categories))
    assert 0.85 < paired["interval"][0] < paired["ratio"] < paired["interval"][1] < 1.0
    # prompts only one side ran are left out of the ratio and the interval alike
    extra = {**slower, "rag-99": 1000.0}
    assert paired_speed_ratio(_speed_records("a", extra, {**categories, "rag-99": "rag"}),
                              _speed_records("b", base, categories)) == paired
    # a single shared prompt: nothing; one prompt per category (--limit 1): drawn as one group, not a point
    one = {"rag-0": 5.0}
    assert paired_speed_ratio(_speed_records("a", one, categories), _speed_records("b", base, categories)) is None
    firsts = {q: s for q, s in base.items() if q.endswith("-0")}
    noisy = {q: s * rng.uniform(0.9, 1.1) for q, s in firsts.items()}
    low, high = paired_speed_ratio(_speed_records("a", noisy, categories),
                                   _speed_records("b", firsts, categories))["interval"]
    assert high - low > 0.02
    # a reference that produced nothing, or a prompt with no tokens: no ratio, never a negative or NaN one
    zeros = {q: 0.0 for q in base}
    assert paired_speed_ratio(_speed_records("a", base, categories), _speed_records("b", zeros, categories)) is None
    some_zero = {**base, "code-0": 0.0, "code-1": 0.0}
    paired = paired_speed_ratio(_speed_records("a", some_zero, categories), _speed_records("b", base, categories))
    assert 0 < paired["interval"][0] < paired["ratio"] < paired["interval"][1] <= 1.0


def test_summary_and_report_carry_the_interval_and_the_versus_table():
    from specdraft.bench.report import format_table, versus_section

    categories, base, _ = _heterogeneous_prompts(seed=2)
    # "same" runs each prompt 3 % faster or slower than ar, in pairs of prompts of equal speed: the same overall
    base = {q: base[q[:-1] + str(int(q[-1]) // 2 * 2)] for q in base}
    same = {q: s * (1.03 if int(q[-1]) % 2 else 1 / 1.03) for q, s in base.items()}
    records = (_speed_records("ar", base, categories)
               + _speed_records("fast", {q: s * 1.2 for q, s in base.items()}, categories)
               + _speed_records("same", same, categories))
    for r in records:
        r.update(target_passes=None, accepted=0, drafted=0, examined=0, identical_to_ar=None, method=r["label"],
                 gamma=None, time_prefill_s=None)
    summary = summarize(records, {}, versus=("same",))
    fast = summary["results"]["fast"]["overall"]
    assert fast["speedup"] == pytest.approx(1.2)
    assert fast["speedup_interval"][0] == pytest.approx(1.2) and fast["speedup_interval"][1] == pytest.approx(1.2)
    assert summary["results"]["ar"]["overall"]["speedup_interval"] is None  # the baseline itself
    table = summary["versus"]["same"]
    assert set(table) == {"ar", "fast"} and table["fast"]["prompts"] == 42
    assert table["fast"]["interval"][0] > 1.1 and table["ar"]["interval"][0] < 1.0 < table["ar"]["interval"][1]
    lines = versus_section(summary)
    assert lines[0] == "## Paired comparison against `same`"
    assert any(line.startswith("| fast | 42 | ") and line.endswith("| faster |") for line in lines)
    assert any(line.startswith("| ar | 42 | ") and line.endswith("| not resolved |") for line in lines)
    assert "| fast | - | " in format_table({**summary, "methods": {k: {"gamma": None} for k in ("ar", "fast", "same")}})
    with pytest.raises(SpecdraftError, match="--versus 'nope': not a method of this run"):
        summarize(records, {}, versus=("nope",))


def test_report_rebuild_takes_versus_and_refuses_a_bad_folder_or_label(bench_run, tmp_path, capsys):
    import shutil

    from specdraft.bench.report import main as report_main

    _, _, _, out = bench_run
    copy_dir = tmp_path / "run"
    shutil.copytree(out, copy_dir)
    assert report_main([str(copy_dir), "--versus", "ar"]) == 0
    summary = json.loads((copy_dir / "summary.json").read_text())
    assert set(summary["versus"]["ar"]) == set(summary["results"]) - {"ar"}
    assert "## Paired comparison against `ar`" in (copy_dir / "report.md").read_text()
    assert report_main([str(copy_dir), "--versus", "draft-g2"]) == 0  # added to the comparisons already asked for
    assert list(json.loads((copy_dir / "summary.json").read_text())["versus"]) == ["ar", "draft-g2"]
    capsys.readouterr()
    assert report_main([str(copy_dir), "--versus", "nope"]) == 2
    assert "not a method of this run" in capsys.readouterr().err
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "holds no bench records" in capsys.readouterr().err
    (copy_dir / "summary.json").unlink()  # a run cut off before its end
    with open(copy_dir / "records.jsonl", "a") as f:
        f.write('{"question_id": "cut off mid-wri')
    assert report_main([str(copy_dir)]) == 2
    assert "the run has not finished" in capsys.readouterr().err


def test_cli_bench_refuses_an_unknown_versus_label_before_loading_models(capsys):
    from specdraft.cli import main

    assert main(["bench", "--methods", "ar,prompt-lookup", "--versus", "draft", "--out", "/nonexistent/x"]) == 2
    assert "--versus 'draft': not a method of this run" in capsys.readouterr().err
