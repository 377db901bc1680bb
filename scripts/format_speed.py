"""What a GGUF block format's matrix product costs here, formats side by side.

    python scripts/format_speed.py --formats Q4_K,Q5_K,Q6_K --rows 8960 --cols 1536 --tokens 1,4,8

Random blocks of each format (valid: moderate half-float scales), repacked into row groups as the loader does,
--matrices distinct matrices multiplied in turn (more bytes than the caches: the weights stream from memory, as in
a decode step). Each round times every (format, pass length) once, the formats' order reversed every other round, so
a neighbour's load on a shared host hits them alike; reported: the median time per matrix, the bytes it read per
second, and the median over rounds of each format's time over the first format's in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdraft.models.native.gguf_weights import BLOCK_SHAPES, BLOCK_TYPES, QuantWeight

TYPE_OF = {name: qtype for qtype, name in BLOCK_TYPES.items()}
HALF_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,),
                "Q5_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_matrix(name: str, rows: int, cols: int, seed: int) -> QuantWeight:
    qtype = TYPE_OF[name]
    per_block, nbytes = BLOCK_SHAPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[name]:
        halves = rng.uniform(0.001, 0.05, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset: offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantWeight(torch.from_numpy(blocks.reshape(rows, -1)), qtype, cols).interleave()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_K,Q5_K,Q6_K")
    parser.add_argument("--rows", type=int, default=8960)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    unknown = [name for name in names if name not in HALF_OFFSETS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(HALF_OFFSETS)}")
    matrices = {name: [random_matrix(name, args.rows, args.cols, seed) for seed in range(args.matrices)]
                for name in names}
    passes = {int(t): torch.randn(int(t), args.cols) for t in args.tokens.split(",")}
    times: dict[tuple[str, int], list[float]] = {(name, t): [] for name in names for t in passes}
    with torch.inference_mode():
        for round_index in range(args.rounds + 1):
            for t, x in passes.items():
                for name in names if round_index % 2 else names[::-1]:
                    started = time.perf_counter()
                    for matrix in matrices[name]:
                        matrix.linear(x, None)
                    if round_index:  # the first round warms up
                        times[(name, t)].append((time.perf_counter() - started) / args.matrices)
    first = names[0]
    for t in passes:
        cells = []
        for name in names:
            seconds = statistics.median(times[(name, t)])
            ratio = statistics.median(a / b for a, b in zip(times[(name, t)], times[(first, t)]))
            cells.append(f"{name} {seconds * 1e3:.3f} ms, {matrices[name][0].nbytes / seconds / 1e9:.1f} GB/s, "
                         f"{ratio:.2f}x {first}")
        print(f"{t:2d} tokens: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
