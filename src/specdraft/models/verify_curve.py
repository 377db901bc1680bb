"""The target's verify-cost curve T(n) / T(1): a pass over n new tokens against a pass over one, measured on this
machine and cached, so `gamma=auto` (draft_length.py) weighs draft lengths by what they cost here.

It is measured after a short and after a long cached context: each new row attends over the whole context, so
a longer context makes the extra rows dearer (2026-12-01, Xeon, on the 1.5B target: T(6) / T(1) 1.15 after 64 tokens,
1.23 after 512, 1.39 after 1,536). `VerifyCurve.at` interpolates linearly in the context length between the two,
and extrapolates past the long one (attention's cost grows linearly with the context).

The curve depends on the model's shape, the dtype, the backend and kernel build, the thread count and the CPU:
all of them name the cache file (~/.cache/specdraft/verify-curves/MODEL-KEY.json). Measuring takes about 30 s for
the 1.5B target (scripts/verify_cost.py has the long form, with a breakdown by kernel).

`draft_price` times a drafter's one-token step against the target's the same way (a second or two, cached beside
the curves): gamma auto prices a draft model's token by its weight bytes times that measured price per byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ..config import SamplingParams
from ..draft_length import VerifyCurve
from ..types import Draft
from .adapter import LoadedModel, NativeState

PREFIX_TOKENS = 64  # cached positions before the timed passes: attention over a short prompt, like a chat turn
LONG_PREFIX_TOKENS = 512  # the second curve's: a long prompt (summarization, rag), still quick to prefill
# Timed rounds; each round times every length once, interleaved, so slow drift hits a round's lengths alike.
# The curve is the median over rounds of each round's T(n) / T(1). The earlier estimator, the fastest of 3
# passes per length, gave T(4) / T(1) = 1.11 and 1.25 in two measurements back to back (2026-12-01): one lucky or
# unlucky T(1) pass moved the whole curve.
ROUNDS = 9
# stored beside the curve: files from another estimator are measured again
ESTIMATOR = f"median of {ROUNDS} rounds' ratios"
# stored beside a draft price: a price measured before a change to what a draft step runs is measured again
# (2: a quantized draft head's fixed rows repacked, drafters/vocab.py `SplitRows`, 2026-12-07)
DRAFT_STEP_FORMAT = 2


def curves_root() -> Path:
    """Where measured curves are kept (SPECDRAFT_VERIFY_CURVES overrides it; the tests point it elsewhere)."""
    override = os.environ.get("SPECDRAFT_VERIFY_CURVES")
    return Path(override) if override else Path.home() / ".cache" / "specdraft" / "verify-curves"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def curve_key(target: LoadedModel, max_tokens: int) -> dict:
    config = target.config
    key = {"model": Path(target.path).name, "layers": target.n_layers, "hidden": target.hidden_size,
           "vocab": target.vocab_size, "kv_heads": getattr(config, "num_key_value_heads", None),
           "dtype": target.dtype_name, "backend": target.backend,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": _cpu_name(),
           "cores": os.cpu_count(), "max_tokens": max_tokens}
    if target.native is not None:
        from .native.kernels import build_dir, chosen_isa

        key["isa"] = chosen_isa()
        key["kernels"] = build_dir().name  # a changed kernel source measures its own curve
    return key


def curve_from_rounds(rounds: list[list[float]]) -> tuple[float, ...]:
    """T(n) / T(1) from timed rounds (rounds[r][n - 1]: round r's pass over n tokens, in seconds): per length the
    median over rounds of the round's own ratio, so a pass that met interference moves one round's ratios, not
    the curve; then made non-decreasing (a longer pass never costs less: a dip is noise, and would make the
    longer draft look free)."""
    if not rounds or not rounds[0]:
        raise ValueError("no timed rounds")
    curve, highest = [], 0.0
    for n in range(len(rounds[0])):
        ratios = sorted(times[n] / times[0] for times in rounds)
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        highest = max(highest, median)
        curve.append(highest)
    return tuple(curve)


def measure(target: LoadedModel, max_tokens: int, prefix: int = PREFIX_TOKENS) -> tuple[float, ...]:
    """T(n) / T(1) for n = 1 .. max_tokens over a `prefix`-token cache: ROUNDS timed rounds of every length
    (after one that warms up allocations and buffers), reduced by `curve_from_rounds`."""
    return curve_from_rounds(time_passes(target, max_tokens, prefix))


def time_passes(target: LoadedModel, max_tokens: int, prefix: int = PREFIX_TOKENS) -> list[list[float]]:
    """ROUNDS timed rounds (after one that warms up allocations and buffers): rounds[r][n - 1] is round r's pass
    over n tokens after the same `prefix` cached tokens, in seconds."""
    vocab = min(target.vocab_size, len(target.tokenizer))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + max_tokens + 1,), generator=generator).tolist()
    state = target.new_state(capacity=prefix + max_tokens + 8)
    rounds = []
    with torch.inference_mode():
        state.forward(ids[:prefix], 1)
        for round_index in range(ROUNDS + 1):
            times = []
            for n in range(1, max_tokens + 1):
                draft = Draft(torch.tensor(ids[prefix + 1: prefix + n], dtype=torch.long))
                started = time.perf_counter()
                state.verify(ids[prefix], draft)
                times.append(time.perf_counter() - started)
                state.truncate(prefix)  # drops the pass's tokens: every pass sees the same `prefix` cached tokens
            if round_index:
                rounds.append(times)
    return rounds


def long_prefix(target: LoadedModel, max_tokens: int) -> int:
    """LONG_PREFIX_TOKENS, or less where the model's positions end sooner (the timed passes need room too)."""
    room = (target.max_positions or LONG_PREFIX_TOKENS * 2) - max_tokens - 8
    return max(PREFIX_TOKENS, min(LONG_PREFIX_TOKENS, room))


def _cache_path(key: dict, folder: str = "") -> Path:
    """The file of a measurement (curves at the top, draft prices in their own folder)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return curves_root() / folder / f"{key['model']}-{digest}.json"


def _store(path: Path, record: dict) -> None:
    """Write a measurement where the next run finds it (a read-only cache: measured again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def draft_price(target: LoadedModel, drafter) -> float:
    """What a byte of `drafter`'s one-token step costs relative to a byte of the target's (1.0 for a drafter that
    is priced by its bytes alone: `Drafter.timed_price` false, or a free one). Timed as the curves are: ROUNDS
    rounds of a one-token target pass and a one-token proposal after a PREFIX_TOKENS-token prompt, the median
    of each round's ratio, then divided by the ratio of their weight bytes. Cached per machine, threads, kernel
    build and drafter. The drafter is left begun on a random prompt: its next `begin` starts afresh."""
    if not drafter.timed_price or not drafter.draft_bytes:
        return 1.0
    setup = drafter.statistics()
    key = {**curve_key(target, 1), "drafter": drafter.name, "draft_bytes": int(drafter.draft_bytes),
           "draft_backend": setup.get("draft_backend", ""), "draft_vocab": setup.get("draft_vocab", 0),
           "estimator": ESTIMATOR, "draft_step": DRAFT_STEP_FORMAT}
    path = _cache_path(key, "draft-prices")
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return float(stored["price"])
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        pass  # absent or unreadable: measure again
    vocab = min(target.vocab_size, len(target.tokenizer))
    # distinct ids (where the vocabulary has enough): no n-gram repeats, so a lookup-first wrapper does not copy and
    # the model's step is what is timed
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
    ids = order.repeat(PREFIX_TOKENS // vocab + 1)[: PREFIX_TOKENS + 1].tolist()
    state = target.new_state(capacity=PREFIX_TOKENS + 8)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    ratios = []
    with torch.inference_mode():
        state.forward(ids[:-1], 1)
        drafter.begin(ids)
        for round_index in range(ROUNDS + 1):
            started = time.perf_counter()
            state.verify(ids[-1], Draft.empty())
            target_seconds = time.perf_counter() - started
            state.truncate(PREFIX_TOKENS)
            started = time.perf_counter()
            drafter.propose(ids, 1, params, None)  # feeds the pending token, drafts one
            draft_seconds = time.perf_counter() - started
            drafter.on_accept(ids)  # nothing kept: the next round drafts the same token again
            if round_index:
                ratios.append(draft_seconds / target_seconds)
    ratios.sort()
    price = ratios[len(ratios) // 2] / (drafter.draft_bytes / target.weight_bytes)
    _store(path, {"key": key, "price": price, "time_ratio": ratios[len(ratios) // 2]})
    return price


# Batch sizes a server's passes are timed at (`batch_curve`): sequences of one token each.
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# A doubled batch pays when it gives at least this much more tokens per second than the batch it doubles. Past that
# point a larger batch only trades each request's speed for an earlier first token to requests that would wait.
MIN_BATCH_GAIN = 1.05


def max_batch_that_pays(relative: tuple[float, ...], sizes: tuple[int, ...] = BATCH_SIZES,
                        min_gain: float = MIN_BATCH_GAIN) -> int:
    """The largest of `sizes` reached by doubling while each step pays: relative[i] is what a pass of sizes[i]
    sequences costs against one of sizes[0], so sizes[i] / relative[i] is its tokens per second in those units."""
    if not sizes or len(relative) != len(sizes):
        raise ValueError(f"one cost per batch size: {len(relative)} costs for {len(sizes)} sizes")
    chosen = 0
    for i in range(1, len(sizes)):
        if sizes[i] / relative[i] < min_gain * sizes[chosen] / relative[chosen]:
            break
        chosen = i
    return sizes[chosen]


def time_batches(target: LoadedModel, sizes: tuple[int, ...], prefix: int = PREFIX_TOKENS) -> list[list[float]]:
    """ROUNDS timed rounds (after one that warms up): rounds[r][i] is round r's pass of sizes[i] sequences, one new
    token each after `prefix` cached tokens of their own (`NativeState.forward_many`, a server's decode pass), in
    seconds. The prompt is prefilled once and its K/V copied into every sequence."""
    vocab = min(target.vocab_size, len(target.tokenizer))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + 1,), generator=generator).tolist()
    first = target.new_state(capacity=prefix + 8)
    with torch.inference_mode():
        first.forward(ids[:prefix], 1)
        kv = first.export_prefix(prefix)
        states = [first]
        for _ in range(max(sizes) - 1):
            state = target.new_state(capacity=prefix + 8)
            state.import_prefix(ids[:prefix], kv)
            states.append(state)
        rounds = []
        for round_index in range(ROUNDS + 1):
            times = []
            for size in sizes:
                started = time.perf_counter()
                NativeState.forward_many(states[:size], [[ids[prefix]]] * size, [1] * size)
                times.append(time.perf_counter() - started)
                for state in states[:size]:
                    state.truncate(prefix)
            if round_index:
                rounds.append(times)
    return rounds


def batch_curve(target: LoadedModel) -> tuple[float, ...] | None:
    """What a pass of n sequences (n in BATCH_SIZES, one token each) costs against a pass of one, on this machine,
    cached beside the verify curves; None where passes of several sequences are not shared (the transformers
    backend runs each request's pass on its own)."""
    if target.native is None:
        return None
    key = {**curve_key(target, max(BATCH_SIZES)), "sizes": list(BATCH_SIZES), "prefix": PREFIX_TOKENS,
           "estimator": ESTIMATOR}
    path = _cache_path(key, "batch-curves")
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and len(stored.get("relative", ())) == len(BATCH_SIZES):
            return tuple(float(x) for x in stored["relative"])
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # absent or unreadable: measure again
    print(f"specdraft: measuring what passes of {', '.join(map(str, BATCH_SIZES))} sequences of {key['model']} cost "
          "on this machine, to size the server's batch (once per machine, thread count and kernel build)...",
          file=sys.stderr, flush=True)
    relative = curve_from_rounds(time_batches(target, BATCH_SIZES))
    _store(path, {"key": key, "sizes": list(BATCH_SIZES), "relative": relative})
    return relative


def verify_curve(target: LoadedModel, max_tokens: int) -> VerifyCurve:
    """The cached curves for this target and machine, measured on first use."""
    key = curve_key(target, max_tokens)
    contexts = (PREFIX_TOKENS, long_prefix(target, max_tokens))
    path = _cache_path(key)
    try:
        stored = json.loads(path.read_text())
        # older files hold the short curve only, or another estimator: measured again
        if stored.get("key") == key and stored.get("contexts") == list(contexts) and stored.get(
                "estimator") == ESTIMATOR and all(
                len(stored.get(name, ())) == max_tokens for name in ("relative", "relative_long")):
            return VerifyCurve(tuple(float(x) for x in stored["relative"]),
                               tuple(float(x) for x in stored["relative_long"]), *contexts)
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # absent or unreadable: measure again
    print(f"specdraft: measuring {key['model']}'s verify cost on this machine for gamma auto (once per machine, "
          f"thread count and kernel build; about 30 s)...", file=sys.stderr, flush=True)
    curve = VerifyCurve(measure(target, max_tokens, contexts[0]), measure(target, max_tokens, contexts[1]), *contexts)
    _store(path, {"key": key, "contexts": list(contexts), "relative": curve.short, "relative_long": curve.long,
                  "estimator": ESTIMATOR})
    return curve
