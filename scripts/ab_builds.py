"""Two versions of the kernels timed in lockstep: this tree and another commit (or tree), each in its own process
with its own kernel build and its own copy of the model, fed one measurement at a time through pipes, the order
swapped every round, so both see the same minute of a shared host. Alternating whole processes (the usual way) lets
a neighbour's load, which moves by 2x within minutes on these VMs, land on one side; in lockstep it lands on both.

    python scripts/ab_builds.py --base 06a3961 --passes 1,4,8,16 --rounds 30
    python scripts/ab_builds.py --base 06a3961 --products 'head:8,down*:8,gate*:1' --rounds 16
    python scripts/ab_builds.py --same --passes 1,8          # this tree against itself: the setup's own bias
    python scripts/ab_builds.py --base HEAD --batches 4,16    # a server's pass of n one-token sequences

--passes: the model's whole pass of k tokens after --prefix cached ones (the least of 3 per round). --products:
NAME:k, the products of the named matrices over k random rows (q, k, v, o, gate, up, down followed by a layer index or
`*` for every layer; head: the full LM head). --batches: a pass of n sequences of one new token each
(`NativeState.forward_many`, a server's decode pass), each after --prefix cached tokens of its own. Prints, per
measurement, each side's median and the median of the per-round ratios (this tree over the base) with its quartiles.
This tree's side (started first) measured 1.03-1.05x the other's with the same tree on both (Zen 4, 2026-12-07,
`--same`): read ratios within that as level, or run `--same` beside a comparison. The base tree is a `git worktree` in
a temporary directory (removed at the end); its kernels build on first use (about 40 s)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def child(model_name: str, prefix: int, threads: int) -> None:
    """Load the model, then answer each line of stdin ('pass k', 'batch n' or 'product NAME k') with milliseconds."""
    import torch

    from specdraft.models.adapter import NativeState, load_model

    torch.set_num_threads(threads)
    model = load_model(model_name, "gguf", progress=False)
    native = model.native
    if native is None:
        raise SystemExit("the model did not load on the native backend")
    ids = torch.randint(0, 1000, (prefix + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    state = model.new_state(capacity=prefix + 80)
    matrices = {"head": native.full_head()}
    for index, layer in enumerate(native.layers):
        for name in MATRICES:
            matrices[f"{name}{index}"] = getattr(layer, name)
    with torch.inference_mode():
        state.forward(ids[:prefix], 1)
        others = []  # the sequences of a batch beside `state`, each with the same prefix cached
        kv = state.export_prefix(prefix)
        print("ready", flush=True)
        for line in sys.stdin:
            kind, *rest = line.split()
            best = float("inf")
            if kind == "pass":
                k = int(rest[0])
                for _ in range(3):
                    started = time.perf_counter()
                    state.forward(ids[prefix: prefix + k], k)
                    best = min(best, time.perf_counter() - started)
                    state.truncate(prefix)
            elif kind == "batch":
                n = int(rest[0])
                while len(others) < n - 1:
                    other = model.new_state(capacity=prefix + 80)
                    other.import_prefix(ids[:prefix], kv)
                    others.append(other)
                batch = [state, *others[: n - 1]]
                for _ in range(3):
                    started = time.perf_counter()
                    NativeState.forward_many(batch, [[ids[prefix]]] * n, [1] * n)
                    best = min(best, time.perf_counter() - started)
                    for sequence in batch:
                        sequence.truncate(prefix)
            else:
                name, k = rest[0], int(rest[1])
                chosen = [m for key, m in matrices.items()
                          if key == name or (name.endswith("*") and key[: len(name) - 1] == name[:-1]
                                             and key[len(name) - 1:].isdigit())]
                if not chosen:
                    raise SystemExit(f"no matrix named {name}")
                rows = [torch.randn(k, m.cols) for m in chosen]
                for _ in range(3):
                    started = time.perf_counter()
                    for m, x in zip(chosen, rows):
                        m.linear(x, None)
                    best = min(best, time.perf_counter() - started)
            print(f"{best * 1e3:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="commit to compare against (checked out into a temporary worktree)")
    parser.add_argument("--base-tree", help="or a checkout of it already on disk")
    parser.add_argument("--same", action="store_true", help="compare this tree with itself")
    parser.add_argument("--passes", default="", help="pass lengths (1 to 64), comma-separated")
    parser.add_argument("--products", default="", help="NAME:k items, comma-separated")
    parser.add_argument("--batches", default="", help="sequences per batched pass (1 to 64), comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="at least 1")
    parser.add_argument("--prefix", type=int, default=64, help="cached tokens before each pass")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.prefix, args.threads)
    if sum(bool(x) for x in (args.base, args.base_tree, args.same)) != 1:
        parser.error("give one of --base, --base-tree, --same")
    work = [("pass", k) for k in args.passes.split(",") if k] + [("batch", n) for n in args.batches.split(",") if n] + [
        ("product", *item.split(":")) for item in args.products.split(",") if item]
    if not work:
        parser.error("nothing to time: give --passes, --batches and/or --products")
    for item in work:
        if item[0] == "product" and (len(item) != 3 or not item[2].isdigit() or int(item[2]) < 1):
            parser.error(f"--products wants NAME:k items with k >= 1, not {':'.join(item[1:])}")
        if item[0] in ("pass", "batch") and not (item[1].isdigit() and 1 <= int(item[1]) <= 64):
            parser.error(f"--{item[0]}es wants numbers from 1 to 64, not {item[1]}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    temporary = None
    command = [sys.executable, __file__, "--child", "--model", args.model, "--prefix", str(args.prefix),
               "--threads", str(args.threads)]
    sides = []
    try:
        if args.base:
            temporary = tempfile.mkdtemp(prefix="specdraft-ab-")
            added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", temporary, args.base],
                                   capture_output=True, text=True)
            if added.returncode:
                raise SystemExit(f"git worktree add {args.base}: {added.stderr.strip()}")
            base_tree = Path(temporary)
        else:
            base_tree = Path(args.base_tree) if args.base_tree else ROOT
        for tree in (ROOT, base_tree):
            # PYTHONPATH replaced, not extended: each side imports its own tree's specdraft and nothing else's
            env = dict(os.environ, PYTHONPATH=str(tree / "src"))
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            sides.append(process)
            if process.stdout.readline().strip() != "ready":
                raise SystemExit(f"the side in {tree} did not start (its error is above)")
        times = {item: ([], []) for item in work}
        for round_index in range(args.rounds):
            for item in work:
                order = (0, 1) if round_index % 2 == 0 else (1, 0)
                for side in order:
                    sides[side].stdin.write(" ".join(item) + "\n")
                    sides[side].stdin.flush()
                    answer = sides[side].stdout.readline()
                    if not answer:
                        raise SystemExit(f"the side in {(ROOT, base_tree)[side]} stopped (its error is above)")
                    times[item][side].append(float(answer))
        print(f"this tree over {args.base or base_tree}, {args.rounds} rounds, {args.threads} threads, ms:")
        for item, (mine, theirs) in times.items():
            ratios = sorted(a / b for a, b in zip(mine, theirs))
            if item[0] == "product":
                label = f"{item[1]} x {item[2]} rows"
            else:
                label = f"pass of {item[1]}" if item[0] == "pass" else f"batch of {item[1]} sequences"
            print(f"  {label}: {statistics.median(mine):.2f} against {statistics.median(theirs):.2f}; per round "
                  f"{statistics.median(ratios):.3f}x (quartiles {ratios[len(ratios) // 4]:.3f}-"
                  f"{ratios[3 * len(ratios) // 4]:.3f})")
    finally:
        for process in sides:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
            process.wait()
        if temporary:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", temporary], check=False,
                           capture_output=True)
            shutil.rmtree(temporary, ignore_errors=True)


if __name__ == "__main__":
    main()
