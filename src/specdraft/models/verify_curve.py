"""The target's verify-cost curve T(n) / T(1): a pass over n new tokens against a pass over one, measured on this
machine and cached, so `gamma=auto` (draft_length.py) weighs draft lengths by what they cost here.

The curve depends on the model's shape, the dtype, the backend and kernel build, the thread count and the CPU:
all of them name the cache file (~/.cache/specdraft/verify-curves/MODEL-KEY.json). Measuring takes a few seconds for
the 1.5B target (scripts/verify_cost.py has the long form, with a breakdown by kernel).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from ..types import Draft
from .adapter import LoadedModel

PREFIX_TOKENS = 64  # cached positions before the timed passes: attention over a short prompt, like a chat turn
REPEATS = 3  # timed passes per length; the fastest counts (the others met interference)


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
    config = target.model.config
    key = {"model": Path(target.path).name, "layers": target.n_layers, "hidden": target.hidden_size,
           "vocab": target.vocab_size, "kv_heads": getattr(config, "num_key_value_heads", None),
           "dtype": str(target.dtype).removeprefix("torch."), "backend": target.backend,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": _cpu_name(),
           "cores": os.cpu_count(), "max_tokens": max_tokens}
    if target.native is not None:
        from .native.kernels import chosen_isa

        key["isa"] = chosen_isa()
    return key


def measure(target: LoadedModel, max_tokens: int) -> tuple[float, ...]:
    """T(n) / T(1) for n = 1 .. max_tokens: the best of REPEATS passes of each length over a PREFIX_TOKENS
    cache, lengths interleaved so that drift hits all of them alike."""
    vocab = min(target.vocab_size, len(target.tokenizer))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (PREFIX_TOKENS + max_tokens + 1,), generator=generator).tolist()
    state = target.new_state(capacity=PREFIX_TOKENS + (REPEATS + 1) * max_tokens + 8)
    best = [float("inf")] * max_tokens
    with torch.inference_mode():
        state.forward(ids[:PREFIX_TOKENS], 1)
        for repeat in range(REPEATS + 1):  # the first round warms up (allocations, first-touch of buffers)
            for n in range(1, max_tokens + 1):
                draft = Draft(torch.tensor(ids[PREFIX_TOKENS + 1: PREFIX_TOKENS + n], dtype=torch.long))
                started = time.perf_counter()
                state.verify(ids[PREFIX_TOKENS], draft)
                elapsed = time.perf_counter() - started
                state.keep_verified([])  # the cache grows by the pending token only
                if repeat:
                    best[n - 1] = min(best[n - 1], elapsed)
    # a longer pass never costs less: a dip is noise, and would make the longer draft look free
    return tuple(max(best[: n + 1]) / best[0] for n in range(max_tokens))


def verify_curve(target: LoadedModel, max_tokens: int) -> tuple[float, ...]:
    """The cached curve for this target and machine, measured on first use."""
    key = curve_key(target, max_tokens)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = curves_root() / f"{key['model']}-{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and len(stored.get("relative", ())) == max_tokens:
            return tuple(float(x) for x in stored["relative"])
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: measure again
    relative = measure(target, max_tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "relative": relative,
                                   "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: use the curve, measure again next time
    return relative
