"""Time one sampled draw over the 1.5B's vocabulary (151,936 tokens): specdraft's inverse-CDF `sample` against
torch.multinomial, and the whole acceptance step (`accept_draft`, temperature 1) for chains of k tokens.

    python scripts/time_sampling.py [THREADS]

Medians of 40 calls on random distributions; docs/performance.md "Sampling one token" has the figures.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdraft.acceptance import accept_draft
from specdraft.config import SamplingParams
from specdraft.sampling import processed_probs, sample
from specdraft.types import Draft

VOCAB = 151936


def median_ms(call, n: int = 40) -> float:
    call()
    runs = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs)


def main() -> int:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    probs = (torch.randn(1, VOCAB) * 3).softmax(-1)  # [1, V]
    print(f"threads {torch.get_num_threads()}: one draw over {VOCAB}: sample {median_ms(lambda: sample(probs, generator)):.3f} ms, "
          f"torch.multinomial {median_ms(lambda: torch.multinomial(probs, 1, generator=generator)):.3f} ms")
    for k in (0, 1, 2, 3, 5, 8):
        logits = torch.randn(k + 1, VOCAB) * 3  # [k + 1, V]
        draft = Draft(torch.randint(0, VOCAB, (k,)))
        print(f"accept_draft k={k}: {median_ms(lambda: accept_draft(draft, logits, params, generator)):.2f} ms "
              f"(processed_probs {median_ms(lambda: processed_probs(logits, params)):.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
