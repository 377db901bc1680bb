"""A GGUF file with its matrices in another block format: a file to time a format the packaged ones lack.

    python scripts/requantize_gguf.py ~/.cache/specdraft/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        out/qwen2.5-coder-1.5b-q5_k_m.gguf --to Q5_K

Matrices in the --from formats (default Q4_K: a Q4_K_M file's Q6_K matrices stay, as in a Q5_K_M file) are
dequantized by the `gguf` package and quantized to --to: Q4_0 or Q8_0 by the `gguf` package, Q5_K here (per
32-weight sub-block its minimum and maximum, six-bit scales and mins against the super-block's largest; llama.cpp
searches for better ones, so these values are a little rougher: the file is for timing, not for quality). Every
metadata field is copied. The result's weights are the source's requantized, so its text differs from the
source's; llama.cpp reads it as it reads its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q5_K": 17}  # llama.cpp's general.file_type (Q5_K: MOSTLY_Q5_K_M)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 176]: Q5_K blocks (d, dmin, scales[12],
    qh[32], qs[128]; weight 64j + 32s + l: nibble s of qs[32j + l], fifth bit: bit 2j + s of qh[l])."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // 256, 8, 32).astype(np.float32)  # [rows, blocks, sub-block, weight]
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / 31  # [rows, blocks, 8]
    d = (step.max(-1) / 63).astype(np.float16)  # [rows, blocks]
    dmin = (-low.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, 63), 0).astype(np.uint8)
        mins = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, 63), 0).astype(np.uint8)
        sub_step = (d32 * scale)[..., None]
        offset = (dmin32 * mins)[..., None]
        q = np.where(sub_step > 0, np.clip(np.rint((sub + offset) / sub_step), 0, 31), 0).astype(np.uint8)
    out = np.zeros((rows, cols // 256, 176), dtype=np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    out[..., 2:4] = dmin.view(np.uint8).reshape(rows, -1, 2)
    for c in range(4):  # the inverse of ggml's get_scale_min_k4
        out[..., 4 + c] = (scale[..., c] & 63) | ((scale[..., c + 4] >> 4) << 6)
        out[..., 8 + c] = (mins[..., c] & 63) | ((mins[..., c + 4] >> 4) << 6)
        out[..., 12 + c] = (scale[..., c + 4] & 0x0F) | ((mins[..., c + 4] & 0x0F) << 4)
    q = q.reshape(rows, cols // 256, 4, 2, 32)  # [rows, blocks, j, s, l]
    fifth = (q >> 4).astype(np.uint8)
    out[..., 16:48] = sum(fifth[:, :, j, s] << (2 * j + s) for j in range(4) for s in range(2))
    out[..., 48:176] = ((q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)).reshape(rows, cols // 256, 128)
    return out.reshape(rows, -1)


def main() -> int:
    import gguf
    from gguf.quants import dequantize, quantize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--to", choices=sorted(FILE_TYPES), required=True)
    parser.add_argument("--from", dest="from_formats", default="Q4_K", help="formats to requantize, by name")
    args = parser.parse_args()
    target = gguf.GGMLQuantizationType[args.to]
    wanted = {gguf.GGMLQuantizationType[name] for name in args.from_formats.split(",")}
    reader = gguf.GGUFReader(args.source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(args.out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = FILE_TYPES[args.to] if name == "general.file_type" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # the reader's shape is fastest-varying first
        if tensor.tensor_type in wanted and len(shape) == 2:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            blocks = quantize_q5_k(values) if args.to == "Q5_K" else quantize(values, target)
            writer.add_tensor(tensor.name, blocks, raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        print(f"{tensor.name} {tensor.tensor_type.name} -> "
              f"{target.name if tensor.tensor_type in wanted and len(shape) == 2 else 'kept'}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
