"""llama.cpp as the benchmark's peer: the refusal without its build, its replies and llama-bench's JSON read from
recorded samples, the bench and report on a stand-in server, `specdraft profile verify`'s arguments; and, where
`make peers` has built it, the real thing on SmolLM2 (marked real)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.bench import peers
from specdraft.bench.methods import BenchModels
from specdraft.bench.options import BenchSettings
from specdraft.bench.peers import (LlamaServer, PeerCompletion, ServerSpec, completion_request, gguf_path,
                                   parse_completion, parse_llama_bench, relative_curve)
from specdraft.bench.profile import format_profile
from specdraft.bench.runner import plan_variants, run_bench
from specdraft.cli import main
from specdraft.errors import SpecdraftError

# A reply of this llama-server (tools/server: server_task_result_cmpl_final::to_json_non_oaicompat) to a request
# with return_tokens, cut to the fields read; it stopped on its end-of-generation token, which `tokens` ends with.
REPLY_EOS = {
    "index": 0, "content": "Hello! How can I help?", "tokens": [19556, 17, 1812, 416, 339, 1073, 47, 2],
    "id_slot": 0, "stop": True, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 8,
    "tokens_evaluated": 31, "truncated": False, "stop_type": "eos", "stopping_word": "", "tokens_cached": 38,
    "timings": {"cache_n": 0, "prompt_n": 31, "prompt_ms": 21.5, "prompt_per_token_ms": 0.69,
                "prompt_per_second": 1441.9, "predicted_n": 8, "predicted_ms": 40.0, "predicted_per_token_ms": 5.0,
                "predicted_per_second": 200.0},
}
REPLY_LIMIT_SPEC = {
    "content": "def f(x):", "tokens": [755, 282, 2075, 1680], "stop_type": "limit", "stopping_word": "",
    "timings": {"cache_n": 0, "prompt_n": 40, "prompt_ms": 120.0, "predicted_n": 4, "predicted_ms": 80.0,
                "draft_n": 6, "draft_n_accepted": 3},
}
# llama-bench -p 1,2,3 -n 0 -d 64 -r 3 -o json, cut to the fields read (README "JSON")
BENCH_JSON = json.dumps([
    {"model_filename": "m.gguf", "n_prompt": k, "n_gen": 0, "n_depth": 64, "avg_ns": int(avg * 1e6),
     "samples_ns": [int(s * 1e6) for s in samples]}
    for k, avg, samples in ((1, 10.5, (10.0, 10.2, 11.3)), (2, 11.4, (11.0, 11.2, 12.0)), (3, 13.0, (12.4, 13.0, 13.6)))
])


def fake_build(cache: Path) -> None:
    """The files `make peers` leaves (binaries that are never run here)."""
    (cache / "peers" / f"llama.cpp-{peers.PEER_VERSION}" / "bin").mkdir(parents=True)
    for name in peers.PEER_BINARIES + peers.PEER_TOOLS:
        peers.peer_binary(cache, name).write_text("")
    from specdraft.bench.peer_build import cmake_flags

    peers.peer_marker(cache).write_text(json.dumps({"version": peers.PEER_VERSION, "llama_cpp_commit": "0c1e570",
                                                    "cmake_flags": list(cmake_flags())}))


# ------------------------------------------------------------------------------------------------ refusal

def test_peer_methods_are_refused_without_the_build_before_any_model_loads(tmp_path):
    for method in ("llama.cpp", "llama.cpp-spec"):
        settings = BenchSettings(methods=("ar", method), cache_dir=str(tmp_path), out=str(tmp_path / "out"))
        with pytest.raises(SpecdraftError, match=r"run `make peers`"):
            plan_variants(settings)


def test_cli_bench_refuses_the_peer_in_one_line_without_loading_a_model(tmp_path, capsys, monkeypatch):
    import specdraft.bench.runner as runner

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(runner, "load_model", no_loading)
    code = main(["bench", "--methods", "ar,llama.cpp", "--cache-dir", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "make peers" in err
    assert not (tmp_path / "o").exists()


def test_the_built_peer_passes_the_check(tmp_path):
    fake_build(tmp_path)
    assert peers.is_built(tmp_path)
    plan_variants(BenchSettings(methods=("llama.cpp", "llama.cpp-spec"), cache_dir=str(tmp_path)))


def test_a_partial_build_without_its_marker_is_not_trusted(tmp_path):
    fake_build(tmp_path)
    peers.peer_marker(tmp_path).unlink()
    assert not peers.is_built(tmp_path)


def test_gamma_auto_is_llama_cpp_s_own_draft_length_and_a_fixed_gamma_is_passed(tmp_path):
    fake_build(tmp_path)
    plan = plan_variants(BenchSettings(methods=("llama.cpp", "llama.cpp-spec"), cache_dir=str(tmp_path)))
    assert [(label, gamma) for label, _, gamma, _ in plan] == [("llama.cpp", None),
                                                                ("llama.cpp-spec", peers.PEER_DRAFT_N_MAX)]
    plan = plan_variants(BenchSettings(methods=("llama.cpp-spec",), gammas=(5,), cache_dir=str(tmp_path)))
    assert plan[0][2] == 5


def test_make_peers_says_so_when_cmake_is_missing(tmp_path, monkeypatch):
    from specdraft.bench import peer_build

    monkeypatch.setattr(peer_build.shutil, "which", lambda name: None)
    with pytest.raises(SpecdraftError, match="cmake is not installed"):
        peer_build.build(tmp_path)
    assert peer_build.main(["--cache-dir", str(tmp_path)]) == 2


def test_make_peers_keeps_a_finished_build(tmp_path, monkeypatch, capsys):
    from specdraft.bench import peer_build

    fake_build(tmp_path)
    monkeypatch.setattr(peer_build, "download_sdist", lambda dest: pytest.fail("downloaded again"))
    assert peer_build.main(["--cache-dir", str(tmp_path)]) == 0
    assert "already built" in capsys.readouterr().out


def test_a_build_without_llama_quantize_is_kept_and_still_runs_the_peer(tmp_path, monkeypatch, capsys):
    """An earlier version's build (no llama-quantize): `make peers` (and so `make bench`) keeps it and says how to
    add the tool, rather than spending ten minutes on a rebuild."""
    from specdraft.bench import peer_build

    fake_build(tmp_path)
    peers.peer_binary(tmp_path, "llama-quantize").unlink()
    assert peers.is_built(tmp_path)  # the bench's peer methods need only the server and llama-bench
    monkeypatch.setattr(peer_build, "download_sdist", lambda dest: pytest.fail("downloaded again"))
    assert peer_build.main(["--cache-dir", str(tmp_path)]) == 0
    assert "without llama-quantize" in capsys.readouterr().out and peers.is_built(tmp_path)


def test_a_finished_rebuild_replaces_the_old_folder_whole(tmp_path, monkeypatch):
    """The build steps faked (no download, no compiler): the new binaries, the server README and the marker land in
    the peer folder together, and nothing of the old folder stays."""
    from specdraft.bench import peer_build

    fake_build(tmp_path)
    (peers.peer_dir(tmp_path) / "stale.txt").write_text("from the old build")

    def extract(archive, dest):
        source = dest / "llama.cpp"
        (source / "tools" / "server").mkdir(parents=True)
        (source / "tools" / "server" / "README.md").write_text("the server's README")
        return source

    def run(cmd, cwd=None):
        if "--build" in cmd:
            bin_dir = Path(cmd[cmd.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True)
            for name in peers.PEER_BINARIES + peers.PEER_TOOLS:
                (bin_dir / name).write_text("new " + name)

    monkeypatch.setattr(peer_build.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(peer_build, "download_sdist", lambda dest: dest / "llama_cpp_python.tar.gz")
    monkeypatch.setattr(peer_build, "extract_llama_cpp", extract)
    monkeypatch.setattr(peer_build, "_run", run)
    monkeypatch.setattr(peer_build, "_vendored_commit", lambda source: None)
    assert peer_build.build(tmp_path, force=True) == peers.peer_dir(tmp_path)
    assert peers.is_built(tmp_path) and not (peers.peer_dir(tmp_path) / "stale.txt").exists()
    assert peers.peer_binary(tmp_path, "llama-quantize").read_text() == "new llama-quantize"
    assert json.loads(peers.peer_marker(tmp_path).read_text())["binaries"] == list(peers.PEER_BINARIES +
                                                                                    peers.PEER_TOOLS)
    assert list(peers.peer_dir(tmp_path).parent.iterdir()) == [peers.peer_dir(tmp_path)]  # no build folder left


def test_make_peers_rebuilds_a_build_made_with_other_flags_and_leaves_amx_out_where_the_cpu_has_it(
        tmp_path, monkeypatch):
    from specdraft.bench import peer_build

    assert peer_build.cmake_flags({"avx2", "avx512f"}) == peer_build.CMAKE_FLAGS
    with_amx = peer_build.cmake_flags({"avx512f", "amx_tile", "amx_int8"})
    assert f"-DCMAKE_CXX_FLAGS={peer_build.NO_AMX}" in with_amx and with_amx[:len(peer_build.CMAKE_FLAGS)] == \
        peer_build.CMAKE_FLAGS
    fake_build(tmp_path)
    marker = json.loads(peers.peer_marker(tmp_path).read_text())
    peers.peer_marker(tmp_path).write_text(json.dumps({**marker, "cmake_flags": ["-DGGML_NATIVE=OFF"]}))

    def downloaded(dest):
        raise SpecdraftError("downloaded again")

    monkeypatch.setattr(peer_build, "download_sdist", downloaded)
    with pytest.raises(SpecdraftError, match="downloaded again"):
        peer_build.build(tmp_path)
    assert peers.is_built(tmp_path)  # a rebuild that fails (here: offline) leaves the working peer in place


# ------------------------------------------------------------------------------------------------ GGUF files

def test_gguf_of_a_packaged_name_a_gguf_file_and_a_converted_folder(tmp_path):
    assert gguf_path("smollm2-135m-instruct", tmp_path) == tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path(str(tmp_path / "x.gguf"), tmp_path) == tmp_path / "x.gguf"
    folder = tmp_path / "models" / "mine"
    folder.mkdir(parents=True)
    (folder / "specdraft.json").write_text(json.dumps({"gguf": "mine.Q8_0.gguf"}))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "mine.Q8_0.gguf").write_text("")
    assert gguf_path(str(folder), tmp_path) == tmp_path / "gguf" / "mine.Q8_0.gguf"
    (tmp_path / "gguf" / "mine.Q8_0.gguf").unlink()
    with pytest.raises(SpecdraftError, match="with its GGUF still in the cache"):
        gguf_path(str(folder), tmp_path)


def test_a_model_without_a_gguf_and_a_missing_file_are_user_errors(tmp_path):
    with pytest.raises(SpecdraftError, match="has none that specdraft knows of"):
        gguf_path(str(tmp_path), tmp_path)
    with pytest.raises(SpecdraftError, match="specdraft models fetch smollm2-135m-instruct"):
        peers.existing_gguf("smollm2-135m-instruct", tmp_path)


# ------------------------------------------------------------------------------------------------ replies

def test_a_reply_that_stopped_on_eos_loses_its_eos_token():
    done = parse_completion(REPLY_EOS)
    assert done.token_ids == [19556, 17, 1812, 416, 339, 1073, 47]
    assert done.eos_token == 2 and done.stop_type == "eos"
    assert done.own_wall_s == pytest.approx(0.0615)
    assert done.timings["predicted_n"] == 8  # its own count, the EOS token included


def test_a_reply_cut_by_the_token_limit_keeps_every_token_and_its_draft_counts():
    done = parse_completion(REPLY_LIMIT_SPEC)
    assert done.token_ids == [755, 282, 2075, 1680] and done.eos_token is None
    assert (done.timings["draft_n"], done.timings["draft_n_accepted"]) == (6, 3)


def test_a_reply_without_tokens_or_timings_is_an_error():
    with pytest.raises(SpecdraftError, match="without tokens or timings"):
        parse_completion({"content": "hi", "timings": REPLY_EOS["timings"]})
    with pytest.raises(SpecdraftError, match="lack predicted_ms"):
        parse_completion({**REPLY_EOS, "timings": {"prompt_n": 1, "prompt_ms": 1.0, "predicted_n": 1}})


def test_the_request_is_greedy_on_token_ids_without_prompt_cache():
    body = completion_request([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["temperature"] == 0 and body["top_k"] == 1
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    assert body["repeat_penalty"] == 1.0 and body["dry_multiplier"] == 0 and body["min_p"] == 0
    sampled = completion_request([1], 4, temperature=0.7, top_k=0, top_p=0.9, seed=3)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["seed"]) == (0.7, 0, 0.9, 3)


def test_the_server_command_is_loopback_one_slot_and_adds_the_draft_for_speculation():
    plain = ServerSpec(Path("/b/llama-server"), Path("/m/t.gguf"), threads=2).command(8123)
    assert plain[:3] == ["/b/llama-server", "-m", "/m/t.gguf"]
    assert plain[plain.index("--host") + 1] == "127.0.0.1" and plain[plain.index("--port") + 1] == "8123"
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("-np") + 1] == "1"
    assert "-md" not in plain
    spec = ServerSpec(Path("/b/llama-server"), Path("/m/t.gguf"), 2, draft=Path("/m/d.gguf"), draft_n_max=4)
    command = spec.command(1)
    assert command[command.index("-md") + 1] == "/m/d.gguf"
    assert command[command.index("--spec-draft-n-max") + 1] == "4"
    assert command[command.index("--spec-type") + 1] == "draft-simple"


def test_a_server_that_exits_at_start_is_an_error_with_its_log(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: cannot open model' >&2\nexit 3\n")
    binary.chmod(0o755)
    server = LlamaServer(ServerSpec(binary, tmp_path / "t.gguf", 1))
    with pytest.raises(SpecdraftError, match=r"exited with status 3(.|\n)*cannot open model"):
        server.start(timeout_s=20)
    assert server.process is None


def test_llama_bench_json_gives_medians_and_the_relative_curve():
    passes = parse_llama_bench(BENCH_JSON)
    assert sorted(passes) == [1, 2, 3]
    assert passes[1]["median_ms"] == pytest.approx(10.2) and passes[1]["avg_ms"] == pytest.approx(10.5)
    assert passes[3]["n_depth"] == 64
    assert relative_curve(passes, 3) == pytest.approx([1.0, 11.2 / 10.2, 13.0 / 10.2])
    with pytest.raises(SpecdraftError, match="no pass of 4 tokens"):
        relative_curve(passes, 4)


def test_llama_bench_output_that_is_not_its_json_is_an_error():
    with pytest.raises(SpecdraftError, match="printed no JSON"):
        parse_llama_bench("| model | size |")
    generation_only = json.dumps([{"n_prompt": 0, "n_gen": 16, "avg_ns": 5, "samples_ns": [5]}])
    assert parse_llama_bench(generation_only) == {}


def test_the_bench_command_asks_for_every_length_at_the_depth():
    cmd = peers.bench_command(Path("/b/llama-bench"), Path("/m/t.gguf"), 4, 64, 2, 3)
    assert cmd[cmd.index("-p") + 1] == "1,2,3,4" and cmd[cmd.index("-n") + 1] == "0"
    assert cmd[cmd.index("-d") + 1] == "64" and cmd[cmd.index("-o") + 1] == "json"


# ------------------------------------------------------------------------------------------------ bench and report

class StandInServer:
    """Answers every turn with the target's first tokens of the prompt reversed (never EOS), timed 10 ms a token."""

    started: list["StandInServer"] = []

    def __init__(self, spec: ServerSpec):
        self.spec, self.stopped = spec, False

    def start(self):
        StandInServer.started.append(self)
        return self

    def complete(self, prompt_ids, max_new_tokens, *args):
        tokens = [t for t in reversed(prompt_ids) if t > 1][:max_new_tokens]
        timings = {"prompt_n": len(prompt_ids), "prompt_ms": 1.0 * len(prompt_ids), "predicted_n": len(tokens),
                   "predicted_ms": 10.0 * len(tokens)}
        if self.spec.draft is not None:
            timings.update(draft_n=4, draft_n_accepted=3)
        return PeerCompletion(tokens, "", "limit", timings, None, http_wall_s=0.5)

    def stop(self):
        self.stopped = True


@pytest.fixture
def stand_in_run(tiny_models, tiny_dirs, tmp_path, monkeypatch):
    fake_build(tmp_path)
    (tmp_path / "t.gguf").write_text("")
    monkeypatch.setattr(peers, "LlamaServer", StandInServer)
    monkeypatch.setattr(peers, "gguf_path", lambda name, cache: tmp_path / "t.gguf")
    StandInServer.started = []
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in (
        {"question_id": "a-1", "category": "a", "turns": ["ab cd", "ef"]},
        {"question_id": "a-2", "category": "a", "turns": ["ga hb"]})))
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "llama.cpp", "llama.cpp-spec"),
                             target=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), max_new_tokens=6,
                             dtype="float32", out=str(tmp_path / "out"), chat=False, warmup_tokens=2,
                             cache_dir=str(tmp_path), command="test")
    models = BenchModels(settings.model_config(), tiny_models["target"], tiny_models["draft"])
    summary = run_bench(settings, progress=False, models=models)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    return summary, records, tmp_path / "out"


def test_peer_records_carry_its_tokens_and_are_timed_by_its_own_clock(stand_in_run):
    _, records, _ = stand_in_run
    peer = [r for r in records if r["label"] == "llama.cpp"]
    assert len(peer) == 3  # two prompts, three turns
    for r in peer:
        assert r["wall_s"] == pytest.approx((r["stats"]["peer_prompt_ms"] + r["stats"]["peer_predicted_ms"]) / 1000)
        assert r["time_prefill_s"] == pytest.approx(r["stats"]["peer_prompt_ms"] / 1000)
        assert r["target_passes"] is None and r["stats"]["backend"] == "llama.cpp"
        assert r["identical_to_ar"] is False  # the stand-in answers differently from the target
    assert all(server.stopped for server in StandInServer.started) and len(StandInServer.started) == 2
    assert [s.spec.draft is not None for s in StandInServer.started] == [False, True]
    assert StandInServer.started[1].spec.draft_n_max == peers.PEER_DRAFT_N_MAX


def test_the_report_sets_the_peer_s_own_rates_beside_ours(stand_in_run):
    summary, records, out = stand_in_run
    table = summary["peers"]
    assert set(table) == {"ar", "llama.cpp", "llama.cpp-spec"}
    peer = [r for r in records if r["label"] == "llama.cpp"]
    decoded = sum(r["stats"]["peer_predicted_n"] for r in peer)
    assert table["llama.cpp"]["decode_tokens_per_s"] == pytest.approx(decoded / (10.0 * decoded / 1000))
    assert table["llama.cpp"]["prompt_tokens_per_s"] == pytest.approx(1000.0)
    assert table["llama.cpp"]["request_tokens_per_s"] == pytest.approx(decoded / (0.5 * len(peer)))
    assert table["llama.cpp-spec"]["draft_acceptance"] == pytest.approx(0.75)
    assert table["llama.cpp-spec"]["identical_to_peer_turns"] == "3/3"  # the stand-in answers alike
    assert table["ar"]["source"] == "our loop's timers" and table["ar"]["decode_tokens_per_s"] > 0
    report = (out / "report.md").read_text()
    assert "## Outside peer: llama.cpp" in report and "| llama.cpp-spec | its own timings |" in report
    assert "llama.cpp on the GGUF's quantized blocks" in report  # the divergence section names why it may differ
    assert "ours on the weights dequantized to float32" in report


def test_a_failing_turn_still_stops_the_server(tiny_models, tiny_dirs, tmp_path, monkeypatch):
    fake_build(tmp_path)
    (tmp_path / "t.gguf").write_text("")

    class Failing(StandInServer):
        def complete(self, *args):
            raise SpecdraftError("llama-server did not answer")

    monkeypatch.setattr(peers, "LlamaServer", Failing)
    monkeypatch.setattr(peers, "gguf_path", lambda name, cache: tmp_path / "t.gguf")
    StandInServer.started = []
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "a-1", "category": "a", "turns": ["ab"]}) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "llama.cpp"), target=str(tiny_dirs["target"]),
                             draft=None, max_new_tokens=4, dtype="float32", out=str(tmp_path / "out"), chat=False,
                             warmup_tokens=2, cache_dir=str(tmp_path))
    models = BenchModels(settings.model_config(), tiny_models["target"], None)
    with pytest.raises(SpecdraftError, match="did not answer"):
        run_bench(settings, progress=False, models=models)
    assert StandInServer.started and all(server.stopped for server in StandInServer.started)


# ------------------------------------------------------------------------------------------------ profile verify

def test_profile_verify_refuses_bad_arguments_in_one_line(capsys):
    for argv, message in ((["--max-tokens", "0"], "--max-tokens must be 1..64"),
                          (["--context", "0"], "--context must be >= 1"),
                          (["--dtype", "int3"], "unknown dtype 'int3'"),
                          (["--threads", "-1"], "--threads must be >= 0")):
        assert main(["profile", "verify", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_profile_verify_without_the_peer_prints_ours_and_says_make_peers(tiny_dirs, tmp_path, capsys):
    code = main(["profile", "verify", "--target", str(tiny_dirs["target"]), "--dtype", "float32", "--max-tokens",
                 "3", "--context", "8", "--threads", "1", "--cache-dir", str(tmp_path), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["ours"]) == 3 and result["ours"][0] == 1.0
    assert result["ours"] == sorted(result["ours"])  # made non-decreasing by verify_curve
    assert result["ours_t1_ms"] > 0
    low, high = result["ours_t1_ms_range"]
    assert 0 < low <= result["ours_t1_ms"] <= high
    assert len(result["ours_ms"]) == 3 and result["ours_ms"][0] == result["ours_t1_ms"]
    assert result["llama_cpp"] is None and "make peers" in result["llama_cpp_missing"]
    assert (result["context"], result["max_tokens"], result["threads"]) == (8, 3, 1)


def test_the_profile_table_puts_the_curves_side_by_side():
    result = {"target": "t", "dtype": "bfloat16", "backend": "native", "threads": 2, "context": 64, "max_tokens": 2,
              "ours": [1.0, 1.1], "ours_t1_ms": 9.5,
              "llama_cpp": {"relative": [1.0, 1.25], "ms": [10.0, 12.5], "gguf": "/m/t.gguf", "version": "0.3.36",
                            "commit": "0c1e570"}, "llama_cpp_missing": None}
    text = format_profile(result)
    assert "  2    1.100      1.250         12.50" in text and "last token only" in text
    assert "T(1) 9.50 ms" in text
    text = format_profile({**result, "ours_ms": [9.5, 10.45], "ours_t1_ms_range": [9.1, 12.0]})
    assert "  2    1.100     10.45      1.250         12.50" in text
    assert "T(1) 9.50 ms (9.10-12.00 over the rounds)" in text
    text = format_profile({**result, "llama_cpp": None, "llama_cpp_missing": "llama.cpp is not built: run `make "
                           "peers` to add its curve"})
    assert "llama.cpp: llama.cpp is not built" in text and "1.250" not in text


# ------------------------------------------------------------------------------------------------ layering

def test_the_core_never_imports_the_peer():
    code = ("import sys, specdraft, specdraft.engine, specdraft.api, specdraft.drafters, specdraft.models.adapter; "
            "assert not [m for m in sys.modules if m.startswith('specdraft.bench')], 'core imported the bench'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------ the real peer

SMOL = "smollm2-135m-instruct"


def _require_built_peer() -> Path:
    from specdraft.models.fetch import cache_root

    cache = cache_root()
    if not peers.is_built(cache):
        pytest.skip(f"llama.cpp is not built in {peers.peer_dir(cache)}: run `make peers` for these tests")
    return cache


@pytest.mark.real
def test_real_peer_in_the_bench_on_smollm2(tmp_path):
    _require_built_peer()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "chat-1", "category": "chat",
                                   "turns": ["Name three colours.", "And three fruits?"]}) + "\n")
    settings = BenchSettings(prompts=str(prompts), methods=("ar", "llama.cpp", "llama.cpp-spec"), target=SMOL,
                             draft=SMOL, max_new_tokens=16, dtype="float32", out=str(tmp_path / "out"),
                             warmup_tokens=2, threads=2, command="test")
    summary = run_bench(settings, progress=False)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    by_label = {label: [r for r in records if r["label"] == label] for label in ("ar", "llama.cpp", "llama.cpp-spec")}
    for label in ("llama.cpp", "llama.cpp-spec"):
        assert len(by_label[label]) == 2
        for r in by_label[label]:
            assert 0 < r["new_tokens"] <= 16 and r["stats"]["peer_predicted_ms"] > 0
            assert r["stats"]["peer_prompt_n"] == r["prompt_tokens"]  # it saw our ids, every one, no cache
            assert r["identical_to_ar"] in (True, False)
            if r["finish_reason"] == "stop":  # the EOS token it appends was dropped, as ours is
                assert r["stats"]["peer_predicted_n"] == r["new_tokens"] + 1
    assert sum(r["stats"].get("peer_draft_n", 0) for r in by_label["llama.cpp-spec"]) > 0  # it did speculate
    # the first turn's answer begins as ours does (the same 4-bit weights; rounding may part them later)
    assert by_label["llama.cpp"][0]["output_ids"][:4] == by_label["ar"][0]["output_ids"][:4]
    assert summary["peers"]["llama.cpp"]["decode_tokens_per_s"] > 0
    assert "## Outside peer: llama.cpp" in (tmp_path / "out" / "report.md").read_text()
    left = subprocess.run(["pgrep", "-f", f"llama.cpp-{peers.PEER_VERSION}/bin/llama-server"], capture_output=True,
                          text=True)
    assert left.stdout.strip() == "", "a llama-server outlived the bench run"


@pytest.mark.real
def test_real_profile_verify_on_smollm2(capsys):
    _require_built_peer()
    code = main(["profile", "verify", "--target", SMOL, "--dtype", "float32", "--max-tokens", "4", "--threads", "2",
                 "--repetitions", "2", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["ours"]) == 4 and len(result["llama_cpp"]["relative"]) == 4
    assert result["llama_cpp"]["relative"][0] == 1.0 and all(ms > 0 for ms in result["llama_cpp"]["ms"])
