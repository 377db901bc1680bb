"""Answer-scale propose and verify: normalisation, verifiers, sandbox containment, calculator, strategies,
the batched sampler against the engine, and the runner end to end on tiny models."""

from __future__ import annotations

import builtins
import json
import os
import time

import pytest

from specdraft.answers.calculator import CalculatorError, evaluate
from specdraft.answers.code import docstring_examples, docstring_tests
from specdraft.answers.normalize import exact_match, find_values, token_f1, value_answer, vote_key
from specdraft.answers.sandbox import namespaces_available, run_python
from specdraft.answers.strategies import majority, select
from specdraft.answers.verifiers import CalculatorVerifier, GroundedVerifier, UnitTestVerifier, build_verifier
from specdraft.errors import SpecdraftError

grounded = GroundedVerifier()

# (rule, answer, source text, expected verdict): every rule has cases that must pass and cases that must not
GROUNDED_CASES = [
    ("thousands separators", "4500000", "It cost 4,500,000 to build.", True),
    ("thousands separators", "4,500,001", "It cost 4,500,000 to build.", False),
    ("decimals", "4.50", "Shares rose to 4.5 on Monday.", True),
    ("decimals", "4.05", "Shares rose to 4.5 on Monday.", False),
    ("percent", "12%", "Sales grew 12 percent last year.", True),
    ("percent", "12 per cent", "Sales grew 12% last year.", True),
    ("percent", "13%", "Sales grew 12 percent last year.", False),
    ("percent vs currency", "12%", "It cost $12.", False),
    ("currency", "$4.5 million", "The deal was worth 4,500,000 dollars.", True),
    ("currency", "4.5m", "The deal was worth $4.5 million.", True),
    ("currency", "4,500,000 dollars", "The deal was worth $4.5 million.", True),
    ("currency", "€4.5 million", "The deal was worth $4.5 million.", False),
    ("scale words", "1.5 million", "About 1,500,000 people voted.", True),
    ("scale words", "2bn", "It raised 2 billion.", True),
    ("scale words", "3k", "A crowd of 3,000 gathered.", True),
    ("scale words", "1,000,000", "They sold a million copies.", True),
    ("scale words", "1.5 billion", "About 1.5 million people voted.", False),
    ("written-out numbers", "3", "Three men were arrested.", True),
    ("written-out numbers", "twenty-five", "He scored 25 points.", True),
    ("written-out numbers", "forty two", "She is 42.", True),
    ("written-out numbers", "4", "Three men were arrested.", False),
    ("month abbreviations", "Sept. 5", "The show closes on September 5.", True),
    ("month abbreviations", "Sep 5", "The show closes on September 5.", True),
    ("month abbreviations", "Oct. 5", "The show closes on September 5.", False),
    ("month names", "May", "The vote is in May.", True),
    ("month names", "May", "Voters may decide in June.", False),
    ("day-month order", "3 March 2020", "On March 3, 2020, the plant closed.", True),
    ("day-month order", "March 3rd", "It closed on the 3rd of March.", True),
    ("day-month order", "4 March 2020", "On March 3, 2020, the plant closed.", False),
    ("partial dates", "March 2020", "On March 3, 2020, the plant closed.", True),
    ("partial dates", "April 2020", "On March 3, 2020, the plant closed.", False),
    ("numeric dates", "March 3, 2020", "Filed 3/3/2020.", True),
    ("numeric dates", "March 4, 2020", "Filed 2020-03-03.", False),
    ("years", "2015", "He joined the company in 2015.", True),
    ("years", "in 2015", "He joined on March 3, 2015.", True),
    ("years", "2016", "He joined the company in 2015.", False),
    ("decades", "1990s", "It was popular in the 1990s.", True),
    ("decades", "1980s", "It was popular in the 1990s.", False),
    ("absent number", "42", "Nothing numeric here but 41 and 43.", False),
    ("not a figure", "the mayor", "The mayor spoke for 20 minutes.", False),
]


@pytest.mark.parametrize("rule,answer,source,expected", GROUNDED_CASES,
                         ids=[f"{c[0]}:{c[1]}:{c[3]}" for c in GROUNDED_CASES])
def test_grounded_verifier_normalisation_rule(rule, answer, source, expected):
    verdict = grounded.verify(answer, source)
    assert verdict.ok is expected, verdict.reason
    assert verdict.reason


def test_grounded_rejects_any_unsupported_figure_in_a_multi_figure_answer():
    assert grounded.verify("3 people in 2015", "In 2015 three people came.").ok
    assert not grounded.verify("3 people in 2016", "In 2015 three people came.").ok


def test_value_answer_accepts_figures_with_one_counted_noun_and_rejects_names():
    assert value_answer("about 300 people") is not None
    assert value_answer("34 years") is not None
    assert value_answer("Route 66") is None
    assert value_answer("the mayor") is None


def test_vote_key_groups_equal_values_written_differently():
    assert vote_key("8") == vote_key("eight") == vote_key("8.")
    assert vote_key("4.5m") == vote_key("$4.5 million")
    assert vote_key("March 3, 2020") == vote_key("3 March 2020")
    assert vote_key("8") != vote_key("9")


def test_squad_exact_match_and_f1():
    assert exact_match("The 1990s.", ["1990s"])
    assert not exact_match("1990", ["1990s"])
    assert token_f1("about 300 people", ["300 people"]) == pytest.approx(0.8)
    assert token_f1("nothing", ["300"]) == 0.0


def test_find_values_reports_spans():
    mentions = find_values("Revenue of $4.5 million on Jan. 5, 1999.")
    assert [m.text for m in mentions] == ["$4.5 million", "Jan. 5, 1999"]


# --- calculator ----------------------------------------------------------------------------------------------

CALCULATOR_CASES = [
    ("17 * 23 = 391", "", True),
    ("17*23 = 392", "", False),
    ("2^10 = 1024", "", True),
    ("2 ** 3 ** 2 = 512", "", True),  # right-associative
    ("(1 + 2) * 3 = 9", "", True),
    ("1 + 2 * 3 = 9", "", False),  # precedence
    ("10 / 4 = 2.5", "", True),
    ("10 / 3 = 3.33", "", True),  # rounded to the decimals written
    ("10 / 3 = 3.34", "", False),
    ("15% of 80 = 12", "", True),
    ("1,250 + 750 = 2,000", "", True),
    ("-3 - -3 = 0", "", True),
    ("391", "17 * 23", True),
    ("390", "17 * 23", False),
]


@pytest.mark.parametrize("answer,source,expected", CALCULATOR_CASES)
def test_calculator_verifier(answer, source, expected):
    verdict = CalculatorVerifier().verify(answer, source)
    assert verdict.ok is expected, verdict.reason


@pytest.mark.parametrize("unsafe", ["__import__('os').system('true')", "abs(-1)", "1 if 1 else 0", "0x10",
                                    "2 ** 100000", "1 / 0", "(1 + 2", "1 2", "", "x"])
def test_calculator_rejects_unsafe_or_malformed_input(unsafe):
    with pytest.raises(CalculatorError):
        evaluate(unsafe)
    assert not CalculatorVerifier().verify(f"{unsafe} = 1", "").ok


def test_calculator_never_calls_eval(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert CalculatorVerifier().verify("(2 + 3) * 4 = 20", "").ok


# --- sandbox -------------------------------------------------------------------------------------------------

def _host_alive() -> None:
    """The host process still runs and can still use the sandbox."""
    result = run_python("print(6 * 7)", timeout_s=5)
    assert result.ok and result.stdout.strip() == "42"


def test_sandbox_runs_good_code_and_reports_failures():
    assert run_python("print('hi')").stdout.strip() == "hi"
    failed = run_python("raise ValueError('boom')")
    assert not failed.ok and "ValueError: boom" in failed.summary()


def test_sandbox_contains_infinite_loop():
    started = time.perf_counter()
    result = run_python("while True:\n    pass\n", timeout_s=1.5)
    assert not result.ok and (result.timed_out or result.returncode < 0)
    assert time.perf_counter() - started < 6
    _host_alive()


def test_sandbox_contains_fork_bomb():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    before = _nobody_processes()
    result = run_python(bomb, timeout_s=1.5, max_procs=16)
    assert not result.ok
    if namespaces_available():  # every process ran as nobody: none may be left once the kernel reaps them
        deadline = time.monotonic() + 5
        while _nobody_processes() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _nobody_processes() - before == set()
    _host_alive()


def _nobody_processes() -> set[str]:
    return {p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == 65534}


def _uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_sandbox_contains_memory_hog():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n", memory_mb=256,
                        timeout_s=10)
    assert not result.ok and "MemoryError" in result.stderr
    _host_alive()


@pytest.mark.parametrize("how", ["open", "os.open", "rename", "remove"])
def test_sandbox_blocks_writes_outside_its_directory(tmp_path, how):
    target = tmp_path / "host_file.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    code = {
        "open": f"open({str(target)!r}, 'w').write('escaped')",
        "os.open": f"import os\nos.write(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT), b'escaped')",
        "rename": f"import os\nos.rename({str(victim)!r}, {str(target)!r})",
        "remove": f"import os\nos.remove({str(victim)!r})",
    }[how]
    result = run_python(code)
    assert not result.ok, result
    assert not target.exists()
    assert victim.read_text() == "keep me"
    assert run_python("open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())").stdout.strip() == "ok"
    _host_alive()


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()",
    "import subprocess\nsubprocess.run(['python3', '-c', 'import socket; socket.socket()'])",
])
def test_sandbox_blocks_network(code):
    result = run_python(code)
    assert not result.ok
    assert "PermissionError" in result.stderr or "not allowed" in result.stderr
    _host_alive()


@pytest.mark.skipif(not namespaces_available(), reason="needs root and util-linux for network namespaces")
def test_sandbox_network_namespace_has_no_route_even_below_python():
    # ctypes is refused by the audit hook; the namespace is the layer under it: check it from a raw /proc read
    result = run_python("print(open('/proc/net/dev').read())")
    assert result.ok
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


# --- code variant --------------------------------------------------------------------------------------------

PROMPT = '''def add(a: int, b: int) -> int:
    """Add two numbers.
    >>> add(2, 3)
    5
    >>> add(-1, 1)
    0
    """
'''


def test_docstring_examples_become_assertions():
    assert docstring_examples(PROMPT, "add") == [("add(2, 3)", "5"), ("add(-1, 1)", "0")]
    arrow = 'def f(x):\n    """\n    f(3) ==> 9\n    f(2) -> 4\n    """\n'
    assert docstring_examples(arrow, "f") == [("f(3)", "9"), ("f(2)", "4")]
    assert docstring_tests('def g():\n    """No examples."""\n', "g") == ""


def test_unit_test_verifier_uses_docstring_examples_only():
    tests = docstring_tests(PROMPT, "add")
    verifier = UnitTestVerifier()
    assert verifier.verify(PROMPT + "    return a + b\n", tests).ok
    # passes the docstring's examples, fails a hidden test (add(1, 1) == 2): verifier and grader differ
    assert verifier.verify(PROMPT + "    return 5 if a == 2 else a + b\n", tests).ok
    assert not verifier.verify(PROMPT + "    return a - b\n", tests).ok
    assert not verifier.verify(PROMPT + "    while True: pass\n", tests).ok
    assert not verifier.verify(PROMPT + "    return a + b\n", "").ok  # nothing to check: not verified


def test_build_verifier_rejects_unknown_name():
    assert build_verifier("grounded").name == "grounded"
    with pytest.raises(SpecdraftError, match="unknown verifier"):
        build_verifier("oracle")


# --- strategies ----------------------------------------------------------------------------------------------

def _entry(answer: str, ok: bool, tokens: int = 2) -> dict:
    return {"text": answer, "answer": answer, "key": vote_key(answer), "tokens": tokens,
            "verdict": {"ok": ok, "reason": ""}, "verify_s": 0.0}


def _record(samples: list[tuple[str, bool]], large: tuple[str, bool], greedy: str = "7") -> dict:
    return {"id": "q", "golds": ["8"],
            "small": {"prompt_tokens": 100, "greedy": _entry(greedy, False), "samples": [_entry(*s) for s in samples],
                      "time_prefill_s": 1.0, "time_greedy_s": 0.5, "time_samples_s": 2.0},
            "large": {"prompt_tokens": 100, "greedy": _entry(*large), "time_prefill_s": 3.0, "time_greedy_s": 1.0},
            "grades": {}}


def test_majority_gives_the_winning_value_in_its_most_common_then_shortest_form():
    answers = ["60 weddings", "60", "61", "60"]
    assert majority(answers, [vote_key(a) for a in answers]) == "60"
    answers = ["Sixty", "60 weddings"]
    assert majority(answers, [vote_key(a) for a in answers]) == "Sixty"


def test_value_match_counts_the_same_figure_written_differently():
    from specdraft.answers.metrics import value_match

    assert value_match("62%", ["62"]) == 1.0
    assert value_match("2", ["two", "two versions"]) == 1.0
    assert value_match("$1,840", ["1840"]) == 1.0
    assert value_match("63%", ["62"]) == 0.0
    assert value_match("the mayor", ["62"]) == 0.0


def test_majority_breaks_ties_by_first_seen():
    assert majority(["a", "b", "b", "a"], ["a", "b", "b", "a"]) == "a"
    assert majority(["8", "eight", "9"], [vote_key(a) for a in ["8", "eight", "9"]]) == "8"
    assert majority([], []) is None


def test_strategies_select_vote_abstain_and_fall_back():
    record = _record([("9", False), ("8", True), ("9", False), ("eight", True)], ("10", False))
    assert select(record, "small-greedy", 4).answer == "7"
    assert select(record, "small-majority", 4).answer == "9"
    assert select(record, "small-majority", 1).answer == "9"
    assert select(record, "small-verified", 4).answer == "8"
    assert select(record, "small-verified", 1).answer is None  # first sample not verified: abstain
    assert select(record, "cascade", 1).answer == "10"  # ... so the cascade asks the large model
    cascade = select(record, "cascade", 4)
    assert cascade.answer == "8" and cascade.large_tokens == 0
    assert select(record, "large-greedy", 4).answer == "10"
    assert select(record, "large-verified", 4).answer is None
    assert select(record, "small-majority", 4).small_tokens == 100 + 4 * 2
    assert select(record, "cascade", 1).large_tokens == 102


# --- sampler and runner on tiny models -----------------------------------------------------------------------

def test_sampled_answers_equal_engine_requests_alone(tiny_models):
    from specdraft import SamplingParams
    from specdraft.answers.sampler import sample_answers
    from specdraft.engine import Engine
    from specdraft.prefix_cache import PrefixCache

    loaded = tiny_models["target"]
    prompt = list(loaded.tokenizer("abc def", add_special_tokens=True)["input_ids"])
    seeds = [11, 12, 13, 14]
    got = sample_answers(Engine(loaded, prefix_cache=PrefixCache(1 << 24)), prompt, 4, 0.9, 8, seeds, stop_rule=None)
    alone = Engine(loaded)
    greedy = alone.generate(prompt, SamplingParams(max_new_tokens=8))
    assert got.greedy.token_ids == greedy.token_ids
    for seed, sample in zip(seeds, got.samples):
        reference = alone.generate(prompt, SamplingParams(temperature=0.9, max_new_tokens=8, seed=seed))
        assert sample.token_ids == reference.token_ids and sample.text == reference.text
    assert len({tuple(s.token_ids) for s in got.samples}) > 1  # the seeds really differ
    assert got.greedy_passes == len(greedy.token_ids) and got.sample_passes >= 4


def test_sampled_answers_share_the_prompts_prefill(tiny_dirs):
    """bf16 on the native backend: the greedy request prefills the prompt, the sampled ones restore its K/V from
    the prefix cache (and still give what they give alone); one-line answers end at their first newline."""
    from specdraft import SamplingParams, load_model
    from specdraft.answers.sampler import one_line, sample_answers
    from specdraft.engine import Engine
    from specdraft.prefix_cache import PrefixCache

    loaded = load_model(str(tiny_dirs["target"]), "bfloat16", backend="native")
    prompt = list(loaded.tokenizer("abc def cab bad", add_special_tokens=True)["input_ids"])
    cache = PrefixCache(1 << 24)
    engine = Engine(loaded, prefix_cache=cache)
    seeds = [3, 4, 5]
    restored = []
    original = cache.restore
    cache.restore = lambda state, ids: restored.append(original(state, ids)) or restored[-1]
    got = sample_answers(engine, prompt, 3, 1.0, 12, seeds, stop_rule=one_line)
    assert restored == [0, len(prompt) - 1, len(prompt) - 1, len(prompt) - 1]
    alone = Engine(loaded)
    for seed, sample in zip(seeds, got.samples):
        reference = alone.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed),
                                   stop_when=one_line)
        assert sample.token_ids == reference.token_ids
        assert not any(one_line(loaded.tokenizer.decode(sample.token_ids[:n], skip_special_tokens=True))
                       for n in range(len(sample.token_ids)))  # no shorter answer was complete


def _tiny_dataset(path, tiny_models) -> list[dict]:
    """Questions whose gold is the small model's own greedy answer (computed by the engine, the reference)."""
    from specdraft import SamplingParams
    from specdraft.answers.runner import QA_SYSTEM
    from specdraft.engine import Engine

    small = tiny_models["draft"]
    rows = []
    for i, context in enumerate(["abc 12 de", "bad 3 cab", "ace 7 bed"]):
        row = {"id": f"t{i}", "context": context, "question": "h?", "answers": []}
        text = f"{QA_SYSTEM}\nArticle: {context}\n\nQuestion: h?\n"
        ids = list(small.tokenizer(text, add_special_tokens=True)["input_ids"])
        greedy = Engine(small).generate(ids, SamplingParams(max_new_tokens=4)).text
        row["answers"] = [greedy.strip().split("\n")[0].rstrip(".").strip() or "x"]
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _recompute(records: list[dict], strategy: str, n: int) -> tuple[float, float]:
    """Accuracy and coverage straight from the records, written independently of metrics.py."""
    right = answered = 0
    for r in records:
        samples = r["small"]["samples"][:n]
        if strategy == "small-greedy":
            answer = r["small"]["greedy"]["answer"]
        elif strategy == "large-greedy":
            answer = r["large"]["greedy"]["answer"]
        elif strategy == "large-verified":
            answer = r["large"]["greedy"]["answer"] if r["large"]["greedy"]["verdict"]["ok"] else None
        else:
            pool = samples if strategy == "small-majority" else [s for s in samples if s["verdict"]["ok"]]
            keys = [s["key"] for s in pool]
            answer = None
            if pool:
                winner = max(pool, key=lambda s: (keys.count(s["key"]), -keys.index(s["key"])))["key"]
                forms = [s["answer"] for s in pool if s["key"] == winner]
                answer = sorted(forms, key=lambda a: (-forms.count(a), len(a), forms.index(a)))[0]
            if answer is None and strategy == "cascade":
                answer = r["large"]["greedy"]["answer"]
        if answer is not None:
            answered += 1
            right += exact_match(answer, r["golds"])
    return right / len(records), answered / len(records)


def test_runner_end_to_end_on_tiny_models(tmp_path, tiny_dirs, tiny_models):
    from specdraft.cli import main

    dataset = tmp_path / "tiny.jsonl"
    rows = _tiny_dataset(dataset, tiny_models)
    out = tmp_path / "out"
    args = ["answers", str(dataset), "--small", str(tiny_dirs["draft"]), "--large", str(tiny_dirs["target"]),
            "--n", "3", "--max-new-tokens", "4", "--out", str(out)]  # --dtype auto: resolved, yet resumable
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").open()]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)
    assert (out / "report.md").read_text().startswith("3 questions")
    assert (out / "accuracy_vs_n.png").stat().st_size > 1000
    table = {row["strategy"]: row for row in summary["table"]}
    assert table["small-greedy"]["accuracy"] == 1.0  # the gold is the small model's greedy answer
    for strategy, row in table.items():
        accuracy, coverage = _recompute(records, strategy, 3)
        assert row["accuracy"] == pytest.approx(accuracy), strategy
        assert row["coverage"] == pytest.approx(coverage), strategy
        assert row["asked"] == 3
    for strategy, values in summary["curve"].items():
        assert values == pytest.approx([_recompute(records, strategy, k)[0] for k in (1, 2, 3)])
    small_params = summary["settings"]["small_params"]
    tokens = sum(r["small"]["prompt_tokens"] + r["small"]["greedy"]["tokens"] for r in records) / 3
    assert table["small-greedy"]["gflops_per_q"] == pytest.approx(2 * small_params * tokens / 1e9)
    # resuming with the same settings adds nothing; other settings into the same folder are refused
    assert main(args) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 3
    assert main(args[:-2] + ["--temperature", "0.5", "--out", str(out)]) == 2


def test_metrics_recomputation_detects_a_wrong_summary(tmp_path):
    """Negative control for the agreement check above: a record changed after summarising must disagree."""
    from specdraft.answers.metrics import summarize

    records = [_record([("8", True)], ("8", True)), _record([("9", False)], ("8", False))]
    for r in records:
        r["grades"] = {a: {"em": float(exact_match(a, r["golds"])), "f1": token_f1(a, r["golds"])}
                       for a in ("7", "8", "9", "10", "eight")}
    settings = {"small_params": 1, "large_params": 3}
    summary = summarize(records, settings)
    table = {row["strategy"]: row for row in summary["table"]}
    assert table["small-verified"]["accuracy"] == pytest.approx(_recompute(records, "small-verified", 1)[0]) == 0.5
    records[1]["small"]["samples"][0]["verdict"]["ok"] = True  # a tampered record
    assert table["small-verified"]["coverage"] != pytest.approx(_recompute(records, "small-verified", 1)[1])


def test_cli_answers_reports_user_mistakes_without_traceback(tmp_path, capsys):
    from specdraft.cli import main

    assert main(["answers", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"id": "1", "context": "c", "question": "q", "answers": ["1"]}\n')
    assert main(["answers", str(dataset), "--n", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--n must be" in capsys.readouterr().err


def test_code_task_grades_with_hidden_tests_and_runs_end_to_end(tmp_path, tiny_dirs):
    from specdraft.answers.runner import CodeTask
    from specdraft.cli import main

    row = {"id": "add", "prompt": PROMPT, "entry_point": "add",
           "test": "def check(candidate):\n    assert candidate(1, 1) == 2\n    assert candidate(2, 3) == 5\n"}
    task = CodeTask()
    assert task.grade("    return a + b", row)["em"] == 1.0
    assert task.grade("    return 5 if a == 2 else 0", row)["em"] == 0.0  # docstring-only solution fails grading
    assert task.answer("    return a + b\n\n\nprint(add(1, 2))\n", row) == "    return a + b"
    dataset = tmp_path / "code.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    assert main(["answers", str(dataset), "--small", str(tiny_dirs["draft"]), "--large", str(tiny_dirs["target"]),
                 "--n", "2", "--max-new-tokens", "6", "--dtype", "float32", "--out", str(out)]) == 0
    record = json.loads((out / "records.jsonl").read_text())
    assert record["small"]["samples"][0]["verdict"]["reason"]  # the docstring examples ran in the sandbox
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["task"] == "code" and summary["settings"]["verifier"] == "unit-tests"
