"""Weights read from a GGUF file and kept in its own block formats (`--dtype gguf`).

The file is memory-mapped: a weight matrix in a supported block format (Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, Q4_1,
IQ4_NL, IQ4_XS) is a `QuantWeight`, a view of the file's bytes that `quant_kernels.cpp` multiplies as it is (no copy,
no widening: a step of the 1.5B reads its 1.0 GiB instead of 3.1 GB of bf16). IQ3_XXS and IQ3_S matrices are
rewritten at load as Q6_K blocks of the same values (`iq3_as_q6_k`). Matrices in other formats are dequantized once
at load (F16 and BF16 kept, F32 as it is, any other block format to bfloat16 through the `gguf` package's own
dequantization); norms and biases are float32.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...errors import SpecdraftError
from ..gguf_header import read_header
from .kernels import load_kernels

# ggml type number -> name, for the block formats the kernels multiply directly
BLOCK_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               20: "IQ4_NL", 23: "IQ4_XS"}
BLOCK_SHAPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144),
                13: (256, 176), 14: (256, 210), 20: (32, 18), 23: (256, 136)}  # (weights, bytes) per block
# the formats whose matrices `interleave` repacks in groups of ROW_GROUP rows -> bytes of one block column of them
INTERLEAVED_BLOCK_BYTES = {2: 144, 6: 176, 8: 272, 10: 672, 11: 1168, 12: 1184, 13: 1440, 14: 1680, 20: 144, 23: 1104}
INTERLEAVED_TYPES = set(INTERLEAVED_BLOCK_BYTES)
ROW_GROUP = 8
INTERLEAVE_ROWS = 8192  # rows `interleave` repacks at a time (a multiple of ROW_GROUP)
HUGE_PAGE = 2 << 20  # bytes of an x86-64 huge page


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of fresh anonymous memory that the kernel is asked to back with 2 MiB pages (where
    transparent huge pages are on `madvise`, the common default, memory from malloc never gets them). A step streams
    every weight once: with 4 KiB pages that is a TLB miss every 4 KiB of a 1 GB read."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # private (a shared anonymous mapping is shmem, whose huge pages are a separate setting); room to start on a
    # 2 MiB boundary
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -np.frombuffer(region, dtype=np.uint8, count=1).ctypes.data % HUGE_PAGE
    try:  # before the first write, so pages are allocated huge; only whole pages (a last partial one would be
        # backed by a whole huge page too)
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages
        pass
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)  # keeps `region` alive


@dataclass
class QuantWeight:
    """A [rows, cols] matrix in a GGUF block format: `blocks` uint8 [rows, row_bytes], each row its own blocks; or,
    `interleaved`, [rows / 8, ...] groups of 8 rows repacked for passes of several tokens (see `interleave`).

    Rows can be selected, copied and assigned like a tensor's (a draft vocabulary takes some rows of a head);
    rows selected from an interleaved matrix come back in the file's layout."""

    blocks: torch.Tensor  # uint8 [N, row_bytes], or [ceil(N / 8), K / 256 * group block bytes] interleaved
    qtype: int  # ggml type number, a key of BLOCK_TYPES
    cols: int  # K, the weights of one row
    interleaved: bool = False
    padding: int = 0  # interleaved: rows of zeros that fill the last group past the N rows (`interleave(pad=True)`)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.cols)

    @property
    def type_name(self) -> str:
        return BLOCK_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def __len__(self) -> int:
        return self.blocks.shape[0] * ROW_GROUP - self.padding if self.interleaved else self.blocks.shape[0]

    def rows_layout(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [n, row_bytes]: rows `rows` [n] int64 (all by default) in the file's block layout."""
        if not self.interleaved:
            return self.blocks if rows is None else self.blocks[rows]
        ids = torch.arange(len(self)) if rows is None else rows.to(torch.long)
        return load_kernels().qdeinterleave_rows(self.blocks, self.qtype, self.cols, ids)

    def __getitem__(self, rows) -> QuantWeight:
        """Rows by slice, index tensor or list (an int keeps one row, as a [1, cols] matrix)."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1) if rows != -1 else slice(-1, None)
        if self.interleaved:
            rows = torch.arange(len(self))[rows]
            return QuantWeight(self.rows_layout(torch.as_tensor(rows).reshape(-1)), self.qtype, self.cols)
        return QuantWeight(self.blocks[rows], self.qtype, self.cols)

    def __setitem__(self, rows, value: QuantWeight) -> None:
        if not isinstance(value, QuantWeight) or (value.qtype, value.cols) != (self.qtype, self.cols):
            raise TypeError("rows of a quantized matrix take rows of the same format and width")
        if self.interleaved:
            raise TypeError("an interleaved matrix is read-only: assign rows of one in the file's layout")
        self.blocks[rows] = value.rows_layout()

    def new_empty(self, rows: int, cols: int) -> QuantWeight:
        if cols != self.cols:
            raise ValueError(f"a quantized matrix keeps its row width {self.cols}, not {cols}")
        row_bytes = self.cols // BLOCK_SHAPES[self.qtype][0] * BLOCK_SHAPES[self.qtype][1]
        return QuantWeight(self.blocks.new_empty(rows, row_bytes), self.qtype, self.cols)

    def equal(self, other: QuantWeight) -> bool:
        layout = (self.qtype, self.cols, self.interleaved, self.padding)
        return layout == (other.qtype, other.cols, other.interleaved, other.padding) and torch.equal(self.blocks,
                                                                                                     other.blocks)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [n, cols]: the rows `rows` [n] int64 (all by default), as the file's format defines them."""
        if self.interleaved:
            blocks = self.rows_layout(rows)
            return load_kernels().qdequantize_rows(blocks, self.qtype, self.cols, torch.arange(len(blocks)))
        ids = torch.arange(len(self)) if rows is None else rows.to(torch.long)
        return load_kernels().qdequantize_rows(self.blocks.contiguous(), self.qtype, self.cols, ids)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, cols] float32 @ this^T (+ bias [rows]) -> [T, rows] float32 (batch-invariant kernels)."""
        if self.interleaved and self.padding:  # the zero rows' outputs dropped: [T, N]
            out = load_kernels().qlinear_x8(x, self.blocks, self.qtype, None)[:, : len(self)].contiguous()
            return out if bias is None else out + bias
        if self.interleaved:
            return load_kernels().qlinear_x8(x, self.blocks, self.qtype, bias)
        return load_kernels().qlinear(x, self.blocks, self.qtype, bias)

    def interleave(self, source: GGUFTensors | None = None, pad: bool = False) -> QuantWeight:
        """This matrix repacked into groups of 8 rows for passes of several tokens (quant_kernels.cpp, "interleaved
        row groups"): a verify pass of 8 tokens then costs about half what it costs row by row. Q2_K to Q6_K, Q8_0,
        Q5_0, Q4_0, IQ4_NL and IQ4_XS with a multiple of 8 rows, or any number with `pad` (an LM head: a fine-tune's
        32,002 rows), whose last group is filled with rows of zero blocks whose outputs `linear` drops; any other
        matrix is returned as it is. Repacked a slice of rows at a time into the final buffer; with `source`, the
        file this matrix is a view of, each slice's mapped pages are released once copied (a 150k-row LM head would
        otherwise be resident twice for a moment)."""
        padding = -len(self) % ROW_GROUP
        if self.interleaved or self.qtype not in INTERLEAVED_TYPES or (padding and not pad) or not len(self):
            return self
        ops = load_kernels()
        group_bytes = self.cols // BLOCK_SHAPES[self.qtype][0] * INTERLEAVED_BLOCK_BYTES[self.qtype]
        groups = (len(self) + padding) // ROW_GROUP
        packed = huge_page_buffer(groups * group_bytes).view(groups, group_bytes)
        whole = len(self) - len(self) % ROW_GROUP  # rows in whole groups
        for start in range(0, whole, INTERLEAVE_ROWS):
            part = self.blocks[start: min(start + INTERLEAVE_ROWS, whole)]
            ops.qinterleave_into(part.contiguous(), self.qtype, self.cols,
                                 packed[start // ROW_GROUP: (start + len(part)) // ROW_GROUP])
            if source is not None:
                source.release(part)
        if padding:  # the last rows and zero blocks (every value 0: a half-float scale of +0) as one more group
            last = self.blocks.new_zeros(ROW_GROUP, self.blocks.shape[1])
            last[: ROW_GROUP - padding] = self.blocks[whole:]
            ops.qinterleave_into(last, self.qtype, self.cols, packed[-1:])
            if source is not None:
                source.release(self.blocks[whole:])
        return QuantWeight(packed, self.qtype, self.cols, interleaved=True, padding=padding)


@dataclass
class PanelWeight:
    """A dense [rows, cols] matrix (float32, bfloat16 or float16) repacked for `linear_panels` (kernels.cpp, "dense
    panels"): `panels` [rows / P, cols, P], P = `dense_panel_rows()` consecutive rows stored column by column. A
    prefill or verify pass then reads each token's activations as broadcasts, not once per pair of rows."""

    panels: torch.Tensor  # [rows / P, cols, P] in the matrix's dtype

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PanelWeight | torch.Tensor:
        """`weight` [N, K] repacked (a copy in fresh memory); returned as it is where this build has no panels
        (AVX-512 builds) or N is no multiple of the panel's rows."""
        rows_per_panel = load_kernels().dense_panel_rows()
        if not rows_per_panel or weight.dim() != 2 or weight.shape[0] % rows_per_panel:
            return weight
        n, k = weight.shape
        panels = huge_page_buffer(weight.numel() * weight.element_size()).view(weight.dtype)
        panels = panels.view(n // rows_per_panel, k, rows_per_panel)
        panels.copy_(weight.view(n // rows_per_panel, rows_per_panel, k).transpose(1, 2))
        return cls(panels)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[0] * self.panels.shape[2], self.panels.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def unpack(self) -> torch.Tensor:
        """The [rows, cols] matrix, row-major (a copy)."""
        return self.panels.transpose(1, 2).reshape(self.shape)

    def equal(self, other: PanelWeight) -> bool:
        return torch.equal(self.panels, other.panels)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, cols] float32 @ this^T (+ bias [rows]) -> [T, rows] float32 (batch-invariant kernels)."""
        return load_kernels().linear_panels(x, self.panels, bias)


def stored_bytes(weight: torch.Tensor | QuantWeight | PanelWeight | None) -> int:
    """Bytes a matrix (or vector) occupies in its stored format (0 for None)."""
    return 0 if weight is None else weight.nbytes


def take_rows(weight: torch.Tensor | QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] int64 of a matrix as float32 [n, cols], whatever its format (embedding lookups)."""
    if isinstance(weight, QuantWeight):
        return weight.dequantize(ids)
    return weight[ids].float()


@dataclass
class GGUFTensors:
    """The tensors of one GGUF file by name, and what the loader did with each format."""

    path: Path
    architecture: str
    tensors: dict[str, torch.Tensor | QuantWeight]
    formats: dict[str, int]  # format name -> how many matrices are in it ("BF16 (dequantized)" for a fallback)
    mapping: np.memmap | None = None  # the file, mapped copy-on-write; the tensors above are views of it

    def release(self, weight: torch.Tensor | QuantWeight) -> None:
        """Tell the kernel that the mapped pages under `weight` (a view of this file) are no longer needed: a
        matrix copied elsewhere (interleaved) would otherwise stay resident twice. Nothing is lost: the mapping
        is never written, so a page read again comes back from the file. Anything not inside the mapping is left
        alone."""
        tensor = weight.blocks if isinstance(weight, QuantWeight) else weight
        if self.mapping is None or tensor.numel() == 0 or not tensor.is_contiguous() or not hasattr(
                mmap, "MADV_DONTNEED"):
            return
        base = self.mapping.ctypes.data
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        if not (base <= start and end <= base + self.mapping.size):
            return
        page = mmap.PAGESIZE
        first, last = -(-(start - base) // page) * page, (end - base) // page * page  # whole pages inside
        if last > first:
            self.mapping._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)

    def get(self, name: str) -> torch.Tensor | QuantWeight | None:
        return self.tensors.get(name)

    def need(self, name: str) -> torch.Tensor | QuantWeight:
        if name not in self.tensors:
            raise SpecdraftError(f"{self.path.name} has no tensor {name!r}: not a {self.architecture} model "
                                 f"file the native backend can read")
        return self.tensors[name]

    def take(self, name: str) -> torch.Tensor | QuantWeight:
        """`need`, and the file's tensors let go of it (a fused matrix whose row blocks are kept instead)."""
        tensor = self.need(name)
        del self.tensors[name]
        return tensor


Q6_K = 14
IQ3_XXS, IQ3_S = 18, 21  # ggml's type numbers
# IQ3_XXS and IQ3_S: where in a block (bytes) its eight 32-weight sub-blocks' scales are, and how a scale field s
# becomes the integer the sub-block's values are multiples of: IQ3_XXS d (2s + 1) g / 4 with g an even grid value
# up to 62 (so d / 2 * (2s + 1) * (g / 2)), IQ3_S d (2s + 1) g with g odd, up to 15
IQ3_SCALES = {IQ3_XXS: (66, 98), IQ3_S: (106, 110)}


def iq3_as_q6_k(raw: np.ndarray, qtype: int) -> np.ndarray | None:
    """IQ3_XXS or IQ3_S rows uint8 [rows, blocks * 98 or 110] as Q6_K rows [rows, blocks * 210] of the same values,
    or None where a block's values are not those of a Q6_K block (an IQ3_XXS d whose half no half float holds, a d
    that is not finite).

    Every value of an IQ3 sub-block is step * q with step = d' * scale, d' a half float (d, or d / 2 for IQ3_XXS),
    scale = 2s + 1 <= 31 and |q| <= 31: a Q6_K block with d', the scale on both of the sub-block's 16-weight halves
    and q + 32 in its six bits. The values come from the `gguf` package's own dequantization, q = value / step, and
    step * q is checked to give every value back exactly (float32 holds these products exactly), so the rewrite
    cannot change a weight: it uses Q6_K's kernels at 210 bytes a block where the file has 98 or 110 (bfloat16
    would take 512)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = raw.shape[0]
    block_bytes = {IQ3_XXS: 98, IQ3_S: 110}[qtype]
    blocks = raw.reshape(rows, -1, block_bytes)
    out = np.empty((rows, blocks.shape[1], 210), dtype=np.uint8)
    for start in range(0, rows, INTERLEAVE_ROWS):
        part = blocks[start: start + INTERLEAVE_ROWS]
        n = part.shape[0]
        d = part[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, blocks]
        first, last = IQ3_SCALES[qtype]
        fields = part[:, :, first:last]
        if qtype == IQ3_XXS:  # the top four bits of each sub-block's 32-bit word
            s = (fields.copy().view(np.uint32) >> 28).astype(np.int32)  # [n, blocks, 8]
            d = d / 2
        else:  # nibbles, sub-block 2i in the low one of byte i
            s = np.stack([fields & 0x0F, fields >> 4], axis=-1).reshape(n, -1, 8).astype(np.int32)
        d_half = d.astype(np.float16)
        if not np.isfinite(d).all() or not np.array_equal(d_half.astype(np.float32), d):
            return None
        scale = 2 * s + 1  # [n, blocks, 8]
        step = d_half.astype(np.float32)[..., None] * scale.astype(np.float32)  # exact: 11 bits times 5
        values = dequantize(part.reshape(n, -1), GGMLQuantizationType(qtype)).reshape(n, -1, 8, 32)
        q = np.rint(np.divide(values, step[..., None], out=np.zeros_like(values), where=step[..., None] != 0))
        if np.abs(q).max(initial=0) > 31 or not np.array_equal(step[..., None] * q, values):
            return None
        q6 = (q.astype(np.int32) + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32)  # [.., half h, chunk k, l]
        target = out[start: start + n]
        # weight 128h + 32k + l: low four bits in nibble k // 2 of ql[64h + 32(k % 2) + l], top two in bits 2k..2k+1
        # of qh[32h + l]
        ql = (q6[:, :, :, 0:2] & 0x0F) | ((q6[:, :, :, 2:4] & 0x0F) << 4)  # [.., h, k % 2, l]
        qh = sum(((q6[:, :, :, k] >> 4) & 3) << (2 * k) for k in range(4))  # [.., h, l]
        target[:, :, :128] = ql.reshape(n, -1, 128)
        target[:, :, 128:192] = qh.astype(np.uint8).reshape(n, -1, 64)
        target[:, :, 192:208] = np.repeat(scale, 2, axis=-1).astype(np.int8).view(np.uint8)
        target[:, :, 208:] = d_half.view(np.uint8).reshape(n, -1, 2)
    return out.reshape(rows, -1)


# formats whose rows are rewritten at load in another one of the same values
CONVERTED_TYPES = {IQ3_XXS: Q6_K, IQ3_S: Q6_K}


def iq3_tables(qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gguf package's grid of an IQ3 format, uint8 [entries, 4], and IQ3_XXS's 128 sign bytes (their data, read
    from the package, not copied here)."""
    from gguf import quants

    kind = quants.IQ3_XXS if qtype == IQ3_XXS else quants.IQ3_S
    kind.init_grid()
    grid = torch.from_numpy(np.ascontiguousarray(kind.grid.reshape(-1, 4)).astype(np.uint8))
    return grid, torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)


def converted_rows(raw: np.ndarray, qtype: int, cols: int) -> torch.Tensor | None:
    """Rows in a CONVERTED_TYPES format rewritten in the format it maps to, or None where they cannot be, by the
    kernels (quant_kernels.cpp, `qconvert_iq3_rows`: a 1.5B's IQ3 matrices in about a second; the numpy twin
    above, which the tests hold it to, takes fifty)."""
    rows = load_kernels().qconvert_iq3_rows(torch.from_numpy(raw), int(qtype), cols, *iq3_tables(qtype))
    return rows if rows.numel() else None


def read_gguf(path: str | Path) -> GGUFTensors:
    """Every tensor of a GGUF file: block-format matrices as memory-mapped QuantWeights, the rest as tensors."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, nothing written back
        header = read_header(memoryview(data))
        metadata, start = header.metadata, header.data_start
        table = [(t.name, t.dims, t.qtype, t.offset) for t in header.tensors]
    except (OSError, ValueError, IndexError, struct.error) as error:
        raise SpecdraftError(f"cannot read {path} as a GGUF file: {error}") from None
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    formats: dict[str, int] = {}
    pages = GGUFTensors(path, "", {}, {}, data)  # releases the file's pages under a tensor converted to a copy
    try:
        for name, dims, qtype, offset in table:
            kind = GGMLQuantizationType(qtype)
            per_block, block_bytes = GGML_QUANT_SIZES[kind]
            n_rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            row_bytes = dims[0] // per_block * block_bytes
            if start + offset + n_rows * row_bytes > len(data):
                raise SpecdraftError(f"{path} is cut short: tensor {name!r} runs past the end of the file")
            raw = data[start + offset: start + offset + n_rows * row_bytes].reshape(n_rows, row_bytes)
            shape = [int(n) for n in reversed(dims)]
            if qtype in BLOCK_TYPES and len(dims) == 2:
                tensors[name] = QuantWeight(torch.from_numpy(raw), qtype, int(dims[0]))
                label = BLOCK_TYPES[qtype]
            elif kind in CONVERTED_TYPES and len(dims) == 2 and (
                    rewritten := converted_rows(raw, kind, int(dims[0]))) is not None:
                into = CONVERTED_TYPES[kind]
                tensors[name] = QuantWeight(rewritten, into, int(dims[0]))
                label = f"{kind.name} (as {BLOCK_TYPES[into]})"
            elif kind == GGMLQuantizationType.BF16:
                tensors[name] = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(shape)
                label = "BF16"
            elif kind == GGMLQuantizationType.F16 and len(dims) == 2:  # widened in registers by the dense kernels
                tensors[name] = torch.from_numpy(raw.view(np.float16)).reshape(shape)
                label = "F16"
            elif kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                values = raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16).astype(np.float32)
                tensors[name] = torch.from_numpy(values).reshape(shape)
                label = kind.name if len(dims) == 1 else f"{kind.name} (as float32)"
            else:  # another block format: dequantized once, kept as bfloat16 for the bf16 kernels
                tensors[name] = torch.from_numpy(dequantize(np.asarray(raw), kind)).reshape(shape).to(torch.bfloat16)
                label = f"{kind.name} (dequantized to bfloat16)"
            held = tensors[name].blocks if isinstance(tensors[name], QuantWeight) else tensors[name]
            if held.data_ptr() != raw.ctypes.data:  # a copy was made (converted, widened): the file's pages go
                pages.release(torch.from_numpy(raw))
            if len(dims) == 2:
                formats[label] = formats.get(label, 0) + 1
    except (ValueError, IndexError, NotImplementedError) as error:  # an unknown type number, a tensor without
        # dimensions, a format the gguf package cannot dequantize
        raise SpecdraftError(f"cannot read {path} as a GGUF file: {error}") from None
    return GGUFTensors(path, str(metadata.get("general.architecture", "unknown")), tensors, formats, data)


def unpermute_rows(weight: torch.Tensor | QuantWeight, n_heads: int) -> torch.Tensor | QuantWeight:
    """llama.cpp's converter reorders the rows of a Llama model's Q and K projections, head by head, from the
    half-split rotary layout of Hugging Face to interleaved pairs (row 2i + s of a head holds row s * Dh/2 + i);
    this puts them back. Rows move whole, so a block-format matrix is reordered without touching its blocks."""
    n_rows = weight.shape[0]
    order = torch.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, QuantWeight):
        return QuantWeight(weight.rows_layout(order).contiguous(), weight.qtype, weight.cols)
    return weight[order].contiguous()
