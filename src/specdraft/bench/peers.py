"""llama.cpp as the benchmark's outside peer: its build in the cache, its server for the bench methods `llama.cpp`
and `llama.cpp-spec`, and its llama-bench for `specdraft profile verify`.

The peer runs on the GGUF file our target came from (the packaged models keep theirs in `<cache>/gguf/`), so
both sides compute with the same quantized weights: llama.cpp with its kernels, our native backend with ours on the
same blocks (--dtype gguf, auto's choice for a GGUF model) or on the weights dequantized (bfloat16, float32).
Prompts go to llama-server as token ids, the ids our chat template made, so it sees exactly what our methods see;
it decodes greedily (temperature 0, top-k 1, every penalty off) with no prompt cache, and its tokens and its own
timings come back.

Build: `make peers` (peer_build.py). Without it the methods are refused before any model loads.

An app-level module: the core (config, engine, drafters, models) never imports it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecdraftError

PEER_PACKAGE = "llama-cpp-python"
PEER_VERSION = "0.3.36"  # its vendor/llama.cpp is the peer
PEER_BINARIES = ("llama-server", "llama-bench")
# built beside them, not needed to run the peer: files of the formats the packaged models lack (docs/benchmarks.md)
PEER_TOOLS = ("llama-quantize",)
MARKER = "peer.json"
PEER_DRAFT_N_MAX = 3  # llama-server's own default draft length (--spec-draft-n-max), used for gamma auto
DEFAULT_CONTEXT = 8192  # llama-server's context (-c): the longest conversation of the suite with room to spare
START_TIMEOUT_S = 300.0  # loading a GGUF and warming up: seconds on this machine, minutes on a cold disk


# ------------------------------------------------------------------------------------------------ the build

def peer_dir(cache: Path) -> Path:
    return cache / "peers" / f"llama.cpp-{PEER_VERSION}"


def peer_marker(cache: Path) -> Path:
    return peer_dir(cache) / MARKER


def peer_binary(cache: Path, name: str) -> Path:
    return peer_dir(cache) / "bin" / name


def is_built(cache: Path) -> bool:
    return peer_marker(cache).is_file() and all(peer_binary(cache, n).is_file() for n in PEER_BINARIES)


def require_peer(cache: Path) -> None:
    """The one-line refusal where the peer is not built."""
    if not is_built(cache):
        raise SpecdraftError(f"llama.cpp is not built: run `make peers` first (it builds llama.cpp {PEER_VERSION} "
                             f"into {peer_dir(cache)}, about 10 minutes on 2 cores)")


def peer_info(cache: Path) -> dict:
    """What the build's marker says (version, vendored commit, cmake flags)."""
    try:
        return json.loads(peer_marker(cache).read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ GGUF files

def gguf_path(name_or_path: str, cache: Path) -> Path:
    """The GGUF file a model came from: a packaged name (its file in <cache>/gguf, fetched with the target, so not
    checked here; `existing_gguf` checks), a .gguf file, or a fetched model folder (its marker names the file)."""
    from ..models.fetch import PACKAGED_MODELS, gguf_source

    if name_or_path in PACKAGED_MODELS:
        return cache / "gguf" / PACKAGED_MODELS[name_or_path].gguf_filename
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return path
    source = gguf_source(path) if path.is_dir() else None
    if source is None:
        raise SpecdraftError(f"llama.cpp runs on GGUF files, and {name_or_path!r} has none that specdraft knows of: "
                             f"use a packaged model ({', '.join(PACKAGED_MODELS)}), a .gguf file, or a folder "
                             "`specdraft models fetch` made (with its GGUF still in the cache)")
    return source


def existing_gguf(name_or_path: str, cache: Path) -> Path:
    path = gguf_path(name_or_path, cache)
    if not path.is_file():
        raise SpecdraftError(f"the GGUF file of {name_or_path!r} is missing ({path}); run `specdraft models fetch "
                             f"{name_or_path}`")
    return path


# ------------------------------------------------------------------------------------------------ the server

@dataclass
class PeerCompletion:
    """One /completion answer: the new tokens (EOS excluded, as ours), the text, why it stopped, and the server's
    own timings (prompt_n, prompt_ms, predicted_n, predicted_ms; draft_n, draft_n_accepted when it drafted).
    predicted_n counts every token it decoded, the end-of-generation token included."""

    token_ids: list[int]
    text: str
    stop_type: str  # eos, limit or word
    timings: dict
    eos_token: int | None = None  # the end-of-generation token that was dropped, if any
    http_wall_s: float = 0.0  # the request as our side saw it (transport and JSON included)

    @property
    def own_wall_s(self) -> float:
        """Prompt processing and generation by the server's clock, like our wall time (prefill included)."""
        return (self.timings["prompt_ms"] + self.timings["predicted_ms"]) / 1000


TIMING_FIELDS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")


def parse_completion(reply: dict) -> PeerCompletion:
    """A non-streamed /completion reply (requested with return_tokens) -> PeerCompletion. The server appends the
    end-of-generation token to `tokens` when it stops on one (stop_type "eos"): dropped here, since our outputs
    exclude EOS."""
    if not isinstance(reply, dict) or "timings" not in reply or "tokens" not in reply:
        raise SpecdraftError(f"llama-server answered without tokens or timings: {str(reply)[:200]}")
    timings = reply["timings"]
    missing = [name for name in TIMING_FIELDS if name not in timings]
    if missing:
        raise SpecdraftError(f"llama-server's timings lack {', '.join(missing)}: {timings}")
    tokens = [int(t) for t in reply["tokens"]]
    stop_type = str(reply.get("stop_type", ""))
    eos = None
    if stop_type == "eos" and tokens:
        eos = tokens.pop()
    return PeerCompletion(tokens, str(reply.get("content", "")), stop_type, dict(timings), eos)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _death_signal():
    """A function for the child, between fork and exec, that asks Linux for a SIGTERM when the bench process dies,
    however it dies (PR_SET_PDEATHSIG); None elsewhere. libc is loaded here, in the parent: the child only calls."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)


@dataclass
class ServerSpec:
    """How to start llama-server: the target's GGUF, threads, context, and the draft for speculative decoding."""

    binary: Path
    model: Path
    threads: int
    context: int = DEFAULT_CONTEXT
    draft: Path | None = None  # llama.cpp-spec: the draft GGUF (--spec-type draft-simple)
    draft_n_max: int = PEER_DRAFT_N_MAX
    slots: int = 1  # requests decoded together (-np; its context is shared among them)
    jinja: bool = False  # chat requests rendered with the GGUF's own template (as transformers renders it)
    extra: tuple[str, ...] = field(default=())

    def command(self, port: int) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context),
               "-np", str(self.slots),  # the bench: one slot, the whole context for the one request at a time
               "--cache-ram", "0",  # no prompt cache between requests (and cache_prompt false in each)
               "--no-webui"]
        if self.draft is not None:
            cmd += ["--spec-type", "draft-simple", "-md", str(self.draft), "--spec-draft-n-max", str(self.draft_n_max),
                    "-td", str(self.threads), "-tbd", str(self.threads)]
        if self.jinja:
            cmd.append("--jinja")
        return cmd + list(self.extra)


class LlamaServer:
    """One llama-server process on a free loopback port, for one bench run: `start()` waits until it is ready,
    `complete()` sends token ids, `stop()` ends it (also when the bench process dies)."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "LlamaServer":
        self.port = free_port()
        self.process = subprocess.Popen(self.spec.command(self.port), stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, preexec_fn=_death_signal())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"llama-server exited with status {self.process.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or 503 while it loads the model
            time.sleep(0.25)
        self._fail(f"llama-server was not ready after {timeout_s:.0f} s")
        raise AssertionError("unreachable")

    def _fail(self, message: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise SpecdraftError(f"{message}; its log ends:\n{tail}")

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def complete(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, timeout_s: float = 3600.0) -> PeerCompletion:
        body = completion_request(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                payload = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise SpecdraftError(f"llama-server refused a {len(prompt_ids)}-token prompt (HTTP {error.code}): "
                                 f"{detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            alive = self.process is not None and self.process.poll() is None
            raise SpecdraftError(f"llama-server did not answer ({error}); "
                                 f"{'it is still running' if alive else 'it exited'}; its log ends:\n"
                                 f"{self.log_tail()}") from None
        result = parse_completion(payload)
        result.http_wall_s = time.perf_counter() - started
        return result

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        try:
            self.log.close()
            os.unlink(self.log.name)
        except OSError:
            pass

    def __enter__(self) -> "LlamaServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def completion_request(prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None) -> dict:
    """The /completion body: token ids as the prompt (no BOS added to an id list), every sampler that is not ours
    turned off, greedy at temperature 0 (top-k 1: the argmax), no prompt cache, the token ids returned."""
    greedy = temperature == 0
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "stream": False,
            "cache_prompt": False, "return_tokens": True,
            "temperature": 0.0 if greedy else float(temperature), "top_k": 1 if greedy else int(top_k),
            "top_p": 1.0 if greedy else float(top_p), "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "mirostat": 0, "seed": -1 if seed is None else int(seed), "n_probs": 0}


# ------------------------------------------------------------------------------------------------ llama-bench

def bench_command(binary: Path, model: Path, max_tokens: int, context: int, threads: int,
                  repetitions: int) -> list[str]:
    """llama-bench's prompt-processing tests of 1 .. max_tokens tokens over a `context`-token cache, as JSON."""
    return [str(binary), "-m", str(model), "-p", ",".join(str(k) for k in range(1, max_tokens + 1)), "-n", "0",
            "-d", str(context), "-t", str(threads), "-r", str(repetitions), "-o", "json"]


def parse_llama_bench(text: str) -> dict[int, dict]:
    """llama-bench `-o json` output -> {k: {"median_ms", "avg_ms", "samples_ms", "n_depth"}} for its
    prompt-processing tests (n_gen 0) of k tokens."""
    try:
        rows = json.loads(text)
    except ValueError as error:
        raise SpecdraftError(f"llama-bench printed no JSON ({error}): {text[:200]}") from None
    if not isinstance(rows, list):
        raise SpecdraftError(f"llama-bench's JSON is not a list of tests: {text[:200]}")
    passes = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("n_gen", 0) != 0 or not row.get("n_prompt"):
            continue
        samples = [ns / 1e6 for ns in row.get("samples_ns") or [row["avg_ns"]]]
        passes[int(row["n_prompt"])] = {"median_ms": statistics.median(samples), "avg_ms": row["avg_ns"] / 1e6,
                                        "samples_ms": samples, "n_depth": row.get("n_depth", 0)}
    return passes


def relative_curve(passes: dict[int, dict], max_tokens: int) -> list[float]:
    """T(k) / T(1) for k = 1 .. max_tokens from llama-bench's passes (medians of its repetitions)."""
    missing = [k for k in range(1, max_tokens + 1) if k not in passes]
    if missing:
        raise SpecdraftError(f"llama-bench reported no pass of {', '.join(map(str, missing))} tokens")
    one = passes[1]["median_ms"]
    return [passes[k]["median_ms"] / one for k in range(1, max_tokens + 1)]


def run_llama_bench(cache: Path, model: Path, max_tokens: int, context: int, threads: int,
                    repetitions: int = 5) -> dict:
    """llama.cpp's verify-cost curve on `model`: {"relative", "ms", "command"}."""
    require_peer(cache)
    cmd = bench_command(peer_binary(cache, "llama-bench"), model, max_tokens, context, threads, repetitions)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SpecdraftError(f"llama-bench failed (exit {proc.returncode}):\n{tail}")
    passes = parse_llama_bench(proc.stdout)
    return {"relative": relative_curve(passes, max_tokens),
            "ms": [passes[k]["median_ms"] for k in range(1, max_tokens + 1)], "command": cmd}
