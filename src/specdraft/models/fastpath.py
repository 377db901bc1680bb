"""Few-row linear layers computed weight-major, for CPUs whose BLAS is slow at skinny GEMMs.

Measured on this project's CI machine (AMD EPYC, AVX2, torch 2.13 with MKL): `F.linear(x, W)` for a
[k, 1536] x [8960, 1536] product takes 3.0 ms at k = 1 but 7.8 ms at k = 2..4 and 10 ms at k = 8, while the same
product written as `(W @ x.T).T` takes 2.7-2.9 ms up to k = 4 and 4.8 ms at k = 8. A verify pass of k tokens is
exactly such a product in every layer, so the first form makes verification cost 2.5x a decode step and erases
the gain of speculative decoding; the second keeps it near the cost of one step (docs/performance.md).

`WeightMajorLinear` is a TorchFunctionMode: inside `with WeightMajorLinear():` every `F.linear` on a CPU tensor
with at most `max_rows` rows is computed as `(W @ x.T).T (+ b)`. It changes no model code and no module
attribute; outside the context nothing is different. The result is the same product with a different
summation order, so values can differ in the last bits (like any change of BLAS kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightMajorLinear(TorchFunctionMode):
    MAX_ROWS = 32

    def __init__(self, max_rows: int = MAX_ROWS):
        super().__init__()
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1] if x.dim() else 0
            if 0 < rows <= self.max_rows and x.device.type == "cpu" and weight.dim() == 2:
                flat = x.reshape(rows, x.shape[-1])  # [rows, in]
                out = torch.mm(weight, flat.t()).t()  # [rows, out]
                if bias is not None:
                    out = out + bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
