"""A GGUF file with its matrices in another block format: a file to time a format the packaged ones lack.

    python scripts/requantize_gguf.py ~/.cache/specdraft/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        out/qwen2.5-coder-1.5b-q5_k_m.gguf --to Q5_K

Matrices in the --from formats (default Q4_K: a Q4_K_M file's Q6_K matrices stay, as in a Q5_K_M file) are
dequantized by the `gguf` package and quantized to --to: Q4_0 or Q8_0 by the `gguf` package, Q5_K, Q3_K and Q2_K
here (Q5_K: per 32-weight sub-block its minimum and maximum, six-bit scales and mins against the super-block's
largest; Q3_K: per 16-weight sub-block its largest magnitude as 4 steps, q - 4 in -4..3, positive six-bit scales
against the super-block's largest step; Q2_K: per 16 weights the minimum and maximum, four-bit scales and mins;
llama.cpp searches for better ones, so these values are rougher: the file is for timing, not for quality). Every
metadata field is copied. The result's weights are the source's requantized, so its text differs from the source's;
llama.cpp reads it as it reads its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q2_K": 10, "Q3_K": 12, "Q5_K": 17}  # llama.cpp's general.file_type


def affine_sub_blocks(sub: np.ndarray, q_max: int, scale_max: int):
    """Sub-blocks [rows, blocks, sub-block, weight] float32 as d * scale * q - dmin * min: per sub-block its minimum
    (at most 0) and maximum over q_max steps, integer scales and mins up to scale_max against the super-block's
    largest, q in 0..q_max. Returns d, dmin (float16 [rows, blocks]), scale, mins ([rows, blocks, sub-blocks]) and
    q (uint8, the shape of `sub`)."""
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / q_max
    d = (step.max(-1) / scale_max).astype(np.float16)
    dmin = (-low.min(-1) / scale_max).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, scale_max), 0).astype(np.uint8)
        mins = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, scale_max), 0).astype(np.uint8)
        sub_step = (d32 * scale)[..., None]
        offset = (dmin32 * mins)[..., None]
        q = np.where(sub_step > 0, np.clip(np.rint((sub + offset) / sub_step), 0, q_max), 0).astype(np.uint8)
    return d, dmin, scale, mins, q


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 176]: Q5_K blocks (d, dmin, scales[12],
    qh[32], qs[128]; weight 64j + 32s + l: nibble s of qs[32j + l], fifth bit: bit 2j + s of qh[l])."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // 256, 8, 32).astype(np.float32)  # [rows, blocks, sub-block, weight]
    d, dmin, scale, mins, q = affine_sub_blocks(sub, q_max=31, scale_max=63)
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


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 110]: Q3_K blocks (hmask[32], qs[64],
    scales[12], d; weight 128n + 32j + 16p + l: low bits (qs[32n + 16p + l] >> 2j) & 3, high bit (hmask[16p + l] >>
    4n + j) & 1, value d * (scale - 32) * (q - 4) with scale 8n + 2j + p)."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // 256, 16, 16).astype(np.float32)  # [rows, blocks, sub-block, weight]
    step = np.abs(sub).max(-1) / 4  # [rows, blocks, 16]
    d = (step.max(-1) / 31).astype(np.float16)  # [rows, blocks]
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, 31), 0).astype(np.uint8)  # [rows, blocks, 16]
        sub_step = (d32 * scale)[..., None]
        q = (np.where(sub_step > 0, np.clip(np.rint(sub / sub_step), -4, 3), 0) + 4).astype(np.uint8)
    q = q.reshape(rows, cols // 256, 2, 4, 2, 16)  # [rows, blocks, n, j, p, l]
    out = np.zeros((rows, cols // 256, 110), dtype=np.uint8)
    out[..., 0:32] = sum(((q[:, :, n, j] >> 2) << (4 * n + j)) for n in range(2) for j in range(4)).reshape(
        rows, -1, 32)
    out[..., 32:96] = sum((q[:, :, :, j] & 3) << (2 * j) for j in range(4)).reshape(rows, -1, 64)
    biased = scale + 32  # six bits
    for s in range(16):
        out[..., 96 + s % 8] |= (biased[..., s] & 0x0F) << (4 * (s // 8))
        out[..., 104 + s % 4] |= (biased[..., s] >> 4) << (2 * (s // 4))
    out[..., 108:110] = d.view(np.uint8).reshape(rows, -1, 2)
    return out.reshape(rows, -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 84]: Q2_K blocks (scales[16]: scale | min
    << 4 per 16 weights, qs[64], d, dmin; weight 128n + 32j + l: (qs[32n + l] >> 2j) & 3, value d * scale * q - dmin
    * min)."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // 256, 16, 16).astype(np.float32)  # [rows, blocks, sub-block, weight]
    d, dmin, scale, mins, q = affine_sub_blocks(sub, q_max=3, scale_max=15)
    q = q.reshape(rows, cols // 256, 2, 4, 32)  # [rows, blocks, n, j, l]
    out = np.zeros((rows, cols // 256, 84), dtype=np.uint8)
    out[..., 0:16] = scale | (mins << 4)
    out[..., 16:80] = sum(q[:, :, :, j] << (2 * j) for j in range(4)).reshape(rows, -1, 64)
    out[..., 80:82] = d.view(np.uint8).reshape(rows, -1, 2)
    out[..., 82:84] = dmin.view(np.uint8).reshape(rows, -1, 2)
    return out.reshape(rows, -1)


# the formats the gguf package cannot quantize
QUANTIZERS = {"Q5_K": quantize_q5_k, "Q3_K": quantize_q3_k, "Q2_K": quantize_q2_k}


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
            blocks = QUANTIZERS[args.to](values) if args.to in QUANTIZERS else quantize(values, target)
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
