"""Load generator for `specdraft serve`: throughput and latency percentiles at several concurrency levels,
speculative against autoregressive, from one server (each request names its method in `speculative`).

    python scripts/load_server.py --url http://127.0.0.1:8000 --concurrency 1,4,16 --methods draft,ar
    python scripts/load_server.py --serve "--target DIR --draft DIR --port 8011" ...   # starts the server too
    python scripts/load_server.py ... --peer-slots 16   # and llama.cpp's llama-server (-np 16), same GGUF, same load

With --peer-slots both servers stay up for the whole run and each concurrency level runs every method of ours and
llama.cpp's in turn (the order rotates each round; --rounds repeats the levels), so that a host whose speed drifts
within the hour moves them alike; an idle server waits without using a core.

Every request is a streamed chat completion (greedy by default) so the client sees the time to the first
token; the last chunk carries the usage and the server's acceptance statistics. A level sends
max(--requests, concurrency) requests with at most `concurrency` in flight. Under greedy decoding the script
also checks that every method gave the same text for the same prompt (speculative decoding is lossless), and
says how many of llama.cpp's texts equal ours (its kernels round differently; equality is not expected).

Every request's message begins with its own number ("Request 17. Write ..."), so requests share only the chat
template's opening (27 tokens of Qwen2.5's 46-48): a prefix cache (ours, llama.cpp's `cache_prompt`) skips only
that, as it would for distinct users, and the same-text check is left to the tests (no two requests send the same
prompt). --repeated-prompts sends the 8 prompts as they are, again and again, and the check runs: with our prefix
cache on, a repeated prompt comes from the cache but its last token, so this checks the cache end to end; for
speed against llama.cpp, which then caches none of them, start ours with --prefix-cache-mb 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python function that flattens a nested list of integers.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that checks whether a number is prime.",
]


REQUEST_NUMBERS = itertools.count(1)  # each request's own number, over the whole run


@dataclass
class Sample:
    prompt: int
    status: int
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    text: str
    stats: dict = field(default_factory=dict)
    error: str = ""
    cached_prompt_tokens: int = 0  # the server's usage.prompt_tokens_details.cached_tokens


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); with few samples p99 is near the max."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


PEER = "llama.cpp"  # the method label of llama.cpp's server


async def one_request(client: httpx.AsyncClient, model: str, prompt_index: int, method: str, max_tokens: int,
                      args) -> Sample:
    content = PROMPTS[prompt_index % len(PROMPTS)]
    if not args.repeated_prompts:
        content = f"Request {next(REQUEST_NUMBERS)}. {content}"
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": args.temperature, "seed": prompt_index, "stream": True,
            "stream_options": {"include_usage": True}}
    if method == PEER:
        # repeated prompts: no slot reuses a cached prompt (a prefix cache would skip whole prompts); unique ones:
        # its slots reuse what their last prompt shares with the next, as our prefix cache does
        body["cache_prompt"] = not args.repeated_prompts
    else:
        body["speculative"] = {"method": method} | ({"gamma": args.gamma} if method != "ar" and args.gamma else {})
    content_chunks = 0
    started = time.perf_counter()
    ttft, parts, usage, stats = None, [], {}, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Sample(prompt_index, response.status_code, time.perf_counter() - started, None, 0, "",
                          error=response.text[:200])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Sample(prompt_index, 500, time.perf_counter() - started, ttft, 0, "",
                              error=chunk["error"]["message"])
            for choice in chunk["choices"]:
                if choice.get("speculative_stats"):  # the choice's own statistics (backend, timings, ...)
                    stats["choice"] = choice["speculative_stats"]
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(content)
                    content_chunks += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
                stats.update(chunk.get("speculative_stats", {}))
            if chunk.get("timings"):  # llama-server's own counts
                usage.setdefault("completion_tokens", chunk["timings"].get("predicted_n", 0))
    # llama-server streams one token per chunk; without usage, its chunks count its tokens
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Sample(prompt_index, 200, time.perf_counter() - started, ttft,
                  usage.get("completion_tokens", content_chunks), "".join(parts), stats, cached_prompt_tokens=cached)


async def run_level(url: str, model: str, method: str, concurrency: int, n_requests: int, max_tokens: int,
                    args) -> dict:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    samples: list[Sample] = []
    # a connection per request: llama-server closes a kept-alive one after a few requests, and a request sent as it
    # closes is lost ("Server disconnected without sending a response")
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        async def worker():
            while not queue.empty():
                samples.append(await one_request(client, model, queue.get_nowait(), method, max_tokens, args))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ok = [s for s in samples if s.status == 200]
    latencies, ttfts = [s.latency_s for s in ok], [s.ttft_s for s in ok if s.ttft_s is not None]
    passes = sum(s.stats.get("target_passes", 0) for s in ok)
    drafted = sum(s.stats.get("drafted", 0) for s in ok)
    accepted = sum(s.stats.get("accepted", 0) for s in ok)
    tokens = sum(s.completion_tokens for s in ok)
    return {
        "method": method, "concurrency": concurrency, "requests": n_requests, "ok": len(ok),
        "rejected_429": sum(s.status == 429 for s in samples),
        "errors": sum(s.status not in (200, 429) for s in samples),
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
        "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99), "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9), "ttft_p99_s": percentile(ttfts, 0.99),
        "tau": tokens / passes if passes else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "cached_prompt_tokens": sum(s.cached_prompt_tokens for s in ok),
        "samples": [asdict(s) for s in samples],
    }


def markdown(levels: list[dict]) -> str:
    """One row per (round, concurrency, method); "× c=1": tokens/s over the same method's at concurrency 1 in the
    same round."""
    lines = ["| round | method | concurrency | requests | ok | 429 | tokens/s | × c=1 | req/s | latency p50 / p90 / p99 "
             "(s) | TTFT p50 / p99 (s) | τ | acceptance |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    single = {(r.get("round", 1), r["method"]): r["tokens_per_s"] for r in levels if r["concurrency"] == 1}
    for r in levels:
        one = single.get((r.get("round", 1), r["method"]))
        ratio = f"{r['tokens_per_s'] / one:.2f}" if one else "-"
        speculative = r["method"] not in ("ar", PEER)
        lines.append(f"| {r.get('round', 1)} | {r['method']} | {r['concurrency']} | {r['requests']} | {r['ok']} "
                     f"| {r['rejected_429']} "
                     f"| {r['tokens_per_s']:.2f} | {ratio} | {r['requests_per_s']:.3f} | {r['latency_p50_s']:.2f} / "
                     f"{r['latency_p90_s']:.2f} / {r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | " + (f"{r['tau']:.2f}" if r["method"] != PEER else "-") + " | "
                     + (f"{r['acceptance_rate']:.2f}" if speculative else "-") + " |")
    return "\n".join(lines)


def lossless_check(levels: list[dict]) -> str:
    """Greedy: the same prompt must give the same text under every method of ours, at every level; llama.cpp's
    texts are compared with ours, not required to equal them."""
    ours: dict[int, set[str]] = {}
    peer: dict[int, set[str]] = {}
    for level in levels:
        for s in level["samples"]:
            if s["status"] == 200:
                (peer if level["method"] == PEER else ours).setdefault(s["prompt"], set()).add(s["text"])
    same = sum(len(texts) == 1 for texts in ours.values())
    line = f"{same}/{len(ours)} prompts gave one identical text across all our methods and levels"
    if peer:
        equal = sum(texts == ours.get(prompt) for prompt, texts in peer.items())
        steady = sum(len(texts) == 1 for texts in peer.values())
        line += (f"; llama.cpp: {steady}/{len(peer)} prompts gave one text at every level, {equal}/{len(peer)} "
                 "the same text as ours")
    return line


def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} before it was healthy")
        try:
            response = httpx.get(url + "/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy server at {url} after {timeout:.0f} s")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def peer_server(args, target: str):
    """llama-server with `--peer-slots` slots (continuous batching is its default) on the target's GGUF and the chat
    template it carries (--jinja: as transformers renders it), not started; None where the peer is not built."""
    from specdraft.bench.peers import LlamaServer, ServerSpec, existing_gguf, is_built, peer_binary
    from specdraft.models.fetch import cache_root

    cache = cache_root(None)
    if not is_built(cache):
        print("llama.cpp's server is not built (`make peers`): its levels are left out", file=sys.stderr)
        return None
    spec = ServerSpec(binary=peer_binary(cache, "llama-server"), model=existing_gguf(target, cache),
                      threads=args.threads, context=512 * args.peer_slots, slots=args.peer_slots, jinja=True,
                      # an HTTP thread per client (its default, a few, drops the connections it cannot take)
                      extra=("--threads-http", str(args.peer_slots + 2)))
    print("starting:", " ".join(spec.command(0)), file=sys.stderr, flush=True)
    return LlamaServer(spec)


def report(levels: list[dict], health: dict, args) -> None:
    print(markdown(levels))
    if args.temperature == 0 and args.repeated_prompts:
        print("\n" + lossless_check(levels))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "server": health, "levels": levels}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--serve", default=None, help="start `specdraft serve` with these arguments (its --port "
                        "must match --url) and stop it with SIGTERM at the end")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--methods", default="draft,ar", help="comma-separated speculative methods to compare")
    parser.add_argument("--gamma", type=int, default=None, help="default: the server's")
    parser.add_argument("--requests", type=int, default=4, help="requests per level (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeated-prompts", action="store_true",
                        help="send the prompts as they are, again and again, rather than each with its own number "
                             "(serve with --prefix-cache-mb 0 then; see above)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    parser.add_argument("--out", default=None, help="write every level and sample as JSON here")
    parser.add_argument("--peer-slots", type=int, default=0, help="also load llama.cpp's llama-server (`make "
                        "peers`) with this many slots (-np) on the target's GGUF, beside ours: each level runs both")
    parser.add_argument("--rounds", type=int, default=1, help="run every level this many times, in turns")
    parser.add_argument("--target", default=None, help="the packaged model (or .gguf) the peer loads (default: the "
                        "one our server names in /health)")
    parser.add_argument("--threads", type=int, default=2, help="the peer's threads")
    args = parser.parse_args(argv)
    levels_c = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")

    process, health, levels = None, {}, []
    if args.serve:
        command = [sys.executable, "-m", "specdraft.cli", "serve", *shlex.split(args.serve)]
        print("starting:", shlex.join(command), file=sys.stderr, flush=True)
        process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with contextlib.ExitStack() as servers:
        if process is not None:
            servers.callback(stop_server, process)
        health = wait_healthy(args.url, process, timeout=600)
        model = health["model"]
        print(f"server: {json.dumps(health)}", file=sys.stderr, flush=True)
        # (url, model name, method) of every method measured: ours, then llama.cpp's server beside ours
        targets = [(args.url, model, method) for method in methods]
        peer = None
        if args.peer_slots:
            try:
                peer = peer_server(args, model if args.target is None else args.target)
                if peer is not None:
                    servers.enter_context(peer)
                    targets.append((peer.url, "peer", PEER))
            except Exception as exc:  # ours are measured: report them, and why the peer's are missing
                print(f"llama.cpp's levels are left out: {exc}", file=sys.stderr)

        def measure(target: tuple[str, str, str], concurrency: int, n_requests: int, max_tokens: int) -> dict | None:
            """A level against one target; a failing peer leaves the run (its log's end printed), ours stop it."""
            try:
                return asyncio.run(run_level(*target, concurrency, n_requests, max_tokens, args))
            except Exception as exc:
                if target[2] != PEER:
                    raise
                print(f"llama.cpp's levels stop here: {type(exc).__name__}: {exc}; llama-server's log ends:\n"
                      f"{peer.log_tail(20)}", file=sys.stderr)
                targets.remove(target)
                return None

        try:
            top = max(levels_c)
            # warm-up at the highest concurrency: first-call costs (an engine per method, a drafter per request in
            # flight, 0.3 s each for the 0.5B draft) are not the servers' steady state
            for target in list(targets):
                measure(target, top, top, 4)
            for round_index in range(args.rounds):
                turn = round_index % len(targets)
                for concurrency in levels_c:
                    for target in targets[turn:] + targets[:turn]:
                        level = measure(target, concurrency, max(args.requests, concurrency), args.max_tokens)
                        if level is not None:
                            level["round"] = round_index + 1
                            levels.append(level)
                            print(markdown([level]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:  # the levels measured so far, whatever stopped the run
            report(levels, health, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
