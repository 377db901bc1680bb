"""A GGUF file's header, read with `struct`: its metadata, tensor table and where the tensor data starts.

The `gguf` package's reader builds numpy objects for every entry of every metadata array: seconds for a
150,000-token vocabulary (twice that for its merges), and transformers' GGUF loading runs it for a model's
config. Here arrays are stepped over, their lengths kept; `metadata_copy` writes a small GGUF with the same
scalar metadata and tensor names and none of the vocabulary, for the parts of transformers that need only those.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF metadata value types: struct formats of the fixed-size ones, 8 a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
SHORT_ARRAY = 1024  # arrays of numbers up to this long are read (a value per layer), longer ones stepped over
_UINT32, _F32 = 4, 0  # a metadata type; a tensor type (ggml's F32)


@dataclass
class TensorEntry:
    name: str
    dims: list[int]  # fastest-varying first, as the file stores them
    qtype: int  # ggml's type number
    offset: int  # from the start of the data section


@dataclass
class GGUFHeader:
    version: int
    # scalars and strings; an array of up to SHORT_ARRAY numbers as a list (Gemma's layer pattern), any other None
    metadata: dict[str, object]
    array_lengths: dict[str, int]  # entries of each array-valued key
    spans: dict[str, tuple[int, int]]  # bytes [start, end) of each key-value pair in the file
    tensors: list[TensorEntry]
    data_start: int  # where tensor offsets count from (aligned)


class _Reader:
    def __init__(self, buffer):
        self.buffer, self.at = buffer, 0

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.read("Q")
        if self.at + length > len(self.buffer):
            raise IndexError("a string runs past the end of the file")
        text = bytes(self.buffer[self.at: self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def value(self, kind: int):
        """A metadata value, or for an array its length and, for a short one of numbers, its entries, as ("array", n,
        list or None)."""
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item_kind, count = self.read("I"), self.read("Q")
        if item_kind in _SCALARS and count <= SHORT_ARRAY:
            return ("array", count, [self.read(_SCALARS[item_kind]) for _ in range(count)])
        if item_kind in _SCALARS:
            self.at += count * struct.calcsize(_SCALARS[item_kind])
        elif item_kind == _STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]
        else:
            for _ in range(count):
                self.value(item_kind)
        return ("array", count, None)


def read_header(buffer) -> GGUFHeader:
    """The header of a GGUF file held in `buffer` (bytes, a memoryview or a memory map). Raises ValueError,
    IndexError or struct.error on a file that is not GGUF or is cut short."""
    reader = _Reader(buffer)
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    reader.at = 4
    version, n_tensors, n_values = reader.read("I"), reader.read("Q"), reader.read("Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is older than this reader (2 and later)")
    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(n_values):
        start = reader.at
        key = reader.string()
        value = reader.value(reader.read("I"))
        if isinstance(value, tuple):
            metadata[key], array_lengths[key] = value[2], value[1]
        else:
            metadata[key] = value
        spans[key] = (start, reader.at)
    tensors = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.read("Q") for _ in range(reader.read("I"))]
        tensors.append(TensorEntry(name, dims, reader.read("I"), reader.read("Q")))
    if reader.at > len(buffer):
        raise IndexError("the header runs past the end of the file")
    alignment = int(metadata.get("general.alignment") or 32)
    data_start = (reader.at + alignment - 1) // alignment * alignment
    return GGUFHeader(version, metadata, array_lengths, spans, tensors, data_start)


def check_tensor_data(header: GGUFHeader, file_size: int) -> None:
    """ValueError naming the first tensor whose data runs past the end of a file of `file_size` bytes (a download
    cut short), or of a type this version of the `gguf` package does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for tensor in header.tensors:
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.qtype)]
        count = 1
        for n in tensor.dims:
            count *= n
        if header.data_start + tensor.offset + count // per_block * block_bytes > file_size:
            raise ValueError(f"tensor {tensor.name!r} runs past the end of the file (cut short?)")


def _string(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return struct.pack("<Q", len(encoded)) + encoded


def metadata_copy(path: str | Path, out: str | Path, arrays_over: int = 1024) -> int | None:
    """Write to `out` a GGUF with `path`'s metadata except arrays of more than `arrays_over` entries (the
    vocabulary's tokens, scores, types and merges), and its tensors' names, each as a one-element F32 tensor.
    Where the file names no `<architecture>.vocab_size`, the copy gets one: the length of its token list (what
    transformers takes as the vocabulary size when the key is missing). Returns that length (None: no token list).
    A file whose tensor data is cut short is refused (ValueError), as reading its weights would be."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as head:
        header = read_header(head)
        check_tensor_data(header, len(head))
        pairs = [head[slice(*span)] for key, span in header.spans.items()
                 if header.array_lengths.get(key, 0) <= arrays_over]
    vocab_key = f"{header.metadata.get('general.architecture')}.vocab_size"
    tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    if vocab_key not in header.metadata and tokens is not None:
        pairs.append(_string(vocab_key) + struct.pack("<II", _UINT32, tokens))
    alignment = int(header.metadata.get("general.alignment") or 32)
    table = b"".join(_string(t.name) + struct.pack("<IQIQ", 1, 1, _F32, alignment * i)
                     for i, t in enumerate(header.tensors))
    body = b"GGUF" + struct.pack("<IQQ", header.version, len(header.tensors), len(pairs)) + b"".join(pairs) + table
    body += b"\0" * (-len(body) % alignment)
    Path(out).write_bytes(body + b"\0" * (alignment * len(header.tensors)))
    return tokens
