"""The GGUF header reader (`models/gguf_header.py`) against the `gguf` package's reader, and the header copy that
transformers reads a GGUF's config from."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from specdraft.models.gguf_header import SHORT_ARRAY, metadata_copy, read_header

TOKENS = [f"t{i}" for i in range(100)]


def write_file(path, vocab_size: int | None = None):
    """A qwen2 GGUF with metadata of every kind and three small tensors; a vocabulary of 100 tokens, with the
    `qwen2.vocab_size` key only when given (llama.cpp's Qwen2.5 files have none)."""
    import gguf

    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if vocab_size is not None:
        writer.add_vocab_size(vocab_size)
    writer.add_int8("test.i8", -3)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_int64("test.i64", -(1 << 40))
    writer.add_uint64("test.u64", 1 << 50)
    writer.add_float64("test.f64", 0.125)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "grüße")
    writer.add_array("test.small", [1, 2, 3])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_merges([f"t {i}" for i in range(60)])
    writer.add_bos_token_id(1)
    writer.add_tensor("token_embd.weight", np.ones((100, 64), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, np.float16))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_read_header_agrees_with_the_gguf_packages_reader(tmp_path):
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    path = tmp_path / "m.gguf"
    write_file(path)
    data = path.read_bytes()
    header = read_header(data)
    reader = GGUFReader(path)
    assert header.version == 3
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file's opening fields
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            assert header.array_lengths[key] == len(field.data), key
            short_numbers = len(field.data) <= SHORT_ARRAY and field.types[1] != GGUFValueType.STRING
            assert header.metadata[key] == (field.contents() if short_numbers else None), key
        else:
            assert header.metadata[key] == pytest.approx(field.contents()), key
    assert list(header.metadata) == [key for key in reader.fields if not key.startswith("GGUF.")]
    assert [(t.name, t.dims, t.qtype, header.data_start + t.offset) for t in header.tensors] == [
        (t.name, [int(n) for n in t.shape], int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    for key, (start, end) in header.spans.items():  # each pair's bytes: its key, then its type and value
        assert struct.unpack_from("<Q", data, start)[0] == len(key.encode())
        assert data[start + 8: start + 8 + len(key.encode())].decode() == key
    assert max(end for _, end in header.spans.values()) < header.data_start


def test_a_header_cut_anywhere_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_file(path)
    data = path.read_bytes()
    end = read_header(data).data_start
    for cut in range(0, end - 31, 7):  # the header's padding (at most 31 bytes) aside
        with pytest.raises((ValueError, IndexError, struct.error)):
            read_header(data[:cut])
    with pytest.raises(ValueError, match="magic"):
        read_header(b"GGML" + data[4:])


@pytest.mark.parametrize("vocab_size", [None, 100])
def test_the_header_copy_gives_transformers_the_files_config(tmp_path, vocab_size):
    """The copy keeps every scalar and small array and the tensor names, drops the vocabulary, and names the
    vocabulary's size where the file does not; transformers makes the same config of it. Negative control: a
    copy without the added size makes another config."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    path, copy = tmp_path / "m.gguf", tmp_path / "copy.gguf"
    write_file(path, vocab_size)
    assert metadata_copy(path, copy, arrays_over=10) == 100  # the token list's length
    original, copied = read_header(path.read_bytes()), read_header(copy.read_bytes())
    assert set(copied.array_lengths) == {"test.small"}
    kept = {k: v for k, v in original.metadata.items() if k not in original.array_lengths or k == "test.small"}
    assert copied.metadata == {**kept, "qwen2.vocab_size": 100}
    assert [t.name for t in copied.tensors] == [t.name for t in original.tensors]
    assert len(GGUFReader(copy).tensors) == 3  # the gguf package reads the copy as a whole file

    def config(file):
        return AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name).to_dict()

    assert config(copy) == config(path)
    assert config(path)["vocab_size"] == 100
    if vocab_size is None:
        bare = tmp_path / "bare.gguf"
        metadata_copy(path, bare, arrays_over=10)
        data = bare.read_bytes()
        start, end = read_header(data).spans["qwen2.vocab_size"]
        n_values = struct.unpack_from("<Q", data, 16)[0]
        bare.write_bytes(data[:16] + struct.pack("<Q", n_values - 1) + data[24:start] + data[end:] + bytes(64))
        assert "qwen2.vocab_size" not in read_header(bare.read_bytes()).metadata
        assert config(bare) != config(path)


def test_a_file_cut_short_in_its_tensor_data_is_refused(tmp_path):
    """The header alone would make a config and tokenizer: the copy checks that every tensor's data is there."""
    path = tmp_path / "m.gguf"
    write_file(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' runs past the end of the file"):
        metadata_copy(path, tmp_path / "copy.gguf")
