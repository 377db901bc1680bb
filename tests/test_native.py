"""The native Llama/Qwen2/Qwen3/Mistral/Gemma forward: same numbers as transformers, batch invariance, the cache,
the choice."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdraft import Engine, SamplingParams, SpecConfig, load_model
from specdraft.drafters import ModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.native import kernels
from specdraft.models.native.gguf_weights import PanelWeight
from specdraft.models.native.llama import MAX_KERNEL_ROWS, native_unsupported_reason
from tiny import build_model

TOKENS = [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5, 11, 2, 6]
ARCHS = ("qwen2", "llama", "qwen3", "mistral", "qwen2-window", "smollm3", "phi3", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def tiny_native(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = {}
    for arch in ARCHS:
        path = build_model(root / arch, seed=5, arch=arch, hidden=64, layers=2)
        for dtype in ("float32", "bfloat16"):
            out[arch, dtype] = load_model(str(path), dtype, backend="native")
    return out


def rounds_activations(dtype) -> bool:
    """The avx512bf16 build multiplies bf16 weights by the activations rounded to bf16 (kernels.cpp)."""
    return dtype in ("bfloat16", torch.bfloat16) and kernels.chosen_isa() in ("avx512bf16", "amx")


def transformers_logits(model, dtype) -> torch.Tensor:
    """The logits of TOKENS by transformers' forward over the native model's weights in float32 (for a bf16 model:
    its bf16 weights, widened; in the avx512bf16 build each linear layer's input rounded to bf16 too, by a forward
    pre-hook). [T, V]"""
    reference_model = copy.deepcopy(model.transformers_model("the reference forward")).float()
    if rounds_activations(dtype):
        for module in reference_model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    with torch.inference_mode():
        return reference_model(input_ids=torch.tensor([TOKENS])).logits[0]


def positions_off(got: torch.Tensor, reference: torch.Tensor, atol: float = 1e-4) -> torch.Tensor:
    """bool [T]: the positions with a logit more than `atol` from the reference's ([T, V] each)."""
    return ((got - reference).abs() > atol).any(-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_logits_match_transformers(tiny_native, arch, dtype):
    """Native computes in float32 over the stored weights: the logits transformers computes from them."""
    model = tiny_native[arch, dtype]
    assert model.backend == "native"
    reference = transformers_logits(model, dtype)
    with torch.inference_mode():
        native = model.new_state().forward(TOKENS, len(TOKENS))
    if not rounds_activations(dtype):
        torch.testing.assert_close(native, reference, atol=1e-4, rtol=0)
        assert torch.equal(native.argmax(-1), reference.argmax(-1))
        return
    # Activations rounded to bf16 (the avx512bf16 build): an input within float32 noise of a rounding boundary (the
    # two forwards sum in other orders) rounds one way here and the other in the reference, and moves the logits
    # after it by up to 2^-8 of a product. On the Zen 4 (2026-12-07) such a flip moved one position of 14 by up to
    # 0.031 in 2 of the 9 models, every other logit within 5e-7; a forward that does not round moves nearly every
    # position (the control below).
    off = positions_off(native, reference)  # [T]
    assert int(off.sum()) <= 2 and float((native - reference).abs().max()) < 0.05
    assert torch.equal(native.argmax(-1)[~off], reference.argmax(-1)[~off])
    assert int(positions_off(transformers_logits(model, "float32"), reference).sum()) > 2


def test_negative_control_qwen3_without_its_head_norms_fails_the_same_check(tiny_native, monkeypatch):
    """The check above sees Qwen3's per-head q and k norms: a forward that skips them (or reads the other one's
    weights) is far off."""
    model = tiny_native["qwen3", "float32"]
    reference = transformers_logits(model, "float32")
    layers = model.native.layers
    for wrong in ({"q_norm": None, "k_norm": None}, {"q_norm": layers[0].k_norm, "k_norm": layers[0].q_norm}):
        with monkeypatch.context() as patch:
            for layer in layers:
                for name, value in wrong.items():
                    patch.setattr(layer, name, value)
            with torch.inference_mode():  # layer by layer: the one-call stack holds the weights it was given
                native = layer_by_layer(model.native, TOKENS, model.native.new_cache(len(TOKENS)))
        assert (native - reference).abs().max() > 1e-2


def without_feature(model, monkeypatch, feature: str) -> None:
    """A tiny model's native forward with one of its family's features taken away (a negative control)."""
    import dataclasses

    from specdraft.models.native.llama import reorder_head_rows, rotary_row_order

    native = model.native
    if feature in ("rotary_scalings", "unturned dims scaled"):  # Phi-3's long RoPE unscaled, or its scale applied
        if feature == "rotary_scalings":  # to the dims it does not turn as well
            monkeypatch.setattr(native, feature, [1.0])
        else:
            monkeypatch.setattr(native, "_unturned", torch.zeros_like(native._unturned))
        monkeypatch.setattr(native, "cos_tables", [native.cos_tables[0][:0]])
        monkeypatch.setattr(native, "sin_tables", [native.sin_tables[0][:0]])
        native._cover_positions(len(TOKENS))
        return
    if feature == "row order":  # q and k rows left in transformers' order
        order = rotary_row_order(native.head_dim, 2 * native.turned_pairs)
        for layer in native.layers:
            monkeypatch.setattr(layer, "q", reorder_head_rows(layer.q, native.n_heads, order.argsort()))
            monkeypatch.setattr(layer, "k", reorder_head_rows(layer.k, native.n_kv_heads, order.argsort()))
        return
    off = {"gelu": False, "embed_scale": 1.0, "attention_scale": 0.0, "attention_softcap": 0.0,
           "final_softcap": 0.0, "windows": (0,) * len(native.layers), "rope_tables": (0,) * len(native.layers)}
    if feature in off:
        monkeypatch.setattr(native, "variant", dataclasses.replace(native.variant, **{feature: off[feature]}))
    elif feature == "norm offsets":  # norms of weight instead of 1 + weight
        for layer in native.layers:
            for name in ("input_norm", "post_norm", "attention_output_norm", "mlp_output_norm"):
                monkeypatch.setattr(layer, name, getattr(layer, name) - 1.0)
    else:  # the attention's or the MLP's output norm left out
        for layer in native.layers:
            monkeypatch.setattr(layer, feature, None)


@pytest.mark.parametrize("arch, feature", [
    *[(arch, feature) for arch in ("gemma2", "gemma3") for feature in (
        "gelu", "embed_scale", "attention_scale", "windows", "norm offsets", "attention_output_norm",
        "mlp_output_norm")],
    ("gemma2", "attention_softcap"), ("gemma2", "final_softcap"), ("gemma3", "rope_tables"), ("mistral", "windows"),
    ("smollm3", "rope_tables"), ("qwen2-window", "windows"),
    *[("phi3", feature) for feature in ("windows", "rotary_scalings", "unturned dims scaled", "row order")]])
def test_negative_control_a_forward_without_each_feature_fails_the_same_check(tiny_native, monkeypatch, arch,
                                                                            feature):
    """The check above sees every way Gemma's layers differ from Llama's (and Mistral's window, SmolLM3's layers
    without RoPE, Phi-3's partial long RoPE): a forward without any one of them is far off (the tiny models' windows
    of 6 positions are crossed by the 14 tokens)."""
    model = tiny_native[arch, "float32"]
    reference = transformers_logits(model, "float32")
    with torch.inference_mode():
        assert (layer_by_layer(model.native, TOKENS, model.native.new_cache(len(TOKENS))) - reference).abs().max() \
            < 1e-4  # the Python layers, as the controls run them
        without_feature(model, monkeypatch, feature)
        native = layer_by_layer(model.native, TOKENS, model.native.new_cache(len(TOKENS)))
    assert (native - reference).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen2-window", "phi3", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_pass_equals_single_steps_bit_for_bit(tiny_native, dtype, arch):
    """Batch invariance: scoring k tokens in one pass gives exactly the logits of k one-token steps (Gemma's: passes
    that cross its sliding window, so that some queries of a pass see every key and others do not)."""
    model = tiny_native[arch, dtype]
    with torch.inference_mode():
        one_pass = model.new_state().forward(TOKENS, len(TOKENS))  # [T, V]
        stepwise_state = model.new_state()
        steps = torch.cat([stepwise_state.forward([t], 1) for t in TOKENS])
        for k in (2, 3, 5, 7):  # chunked passes of every tile shape the kernels use
            state = model.new_state()
            chunks = [state.forward(TOKENS[i:i + k], len(TOKENS[i:i + k])) for i in range(0, len(TOKENS), k)]
            assert torch.equal(torch.cat(chunks), steps), f"chunks of {k} differ from single steps"
    assert torch.equal(one_pass, steps)


def test_a_tree_under_a_sliding_window_gives_each_node_its_branch_as_a_chain(tiny_native):
    """Gemma's local layers in a tree pass: each node sees the prefix keys its window reaches from its own position,
    as its branch run as a chain does (the 14-token prefix is past the tiny model's window of 6); a tree over more
    slots than the window spans is refused."""
    model = tiny_native["gemma3", "float32"]
    ids, parents = [7, 8, 9, 10, 11], [-1, -1, 0, 0, 2]  # two roots, a branch of depth 3
    with torch.inference_mode():
        state = model.new_state()
        state.forward(TOKENS, 1)
        tree = state.forward_tree(ids, parents, len(ids))  # [5, V]
        for node in range(len(ids)):
            branch, at = [], node
            while at >= 0:
                branch, at = [ids[at]] + branch, parents[at]
            assert torch.equal(tree[node], model.new_state().forward(TOKENS + branch, 1)[0])
        state = model.new_state()
        state.forward(TOKENS, 1)
        with pytest.raises(SpecdraftError, match="a token tree over 7 cache slots is wider than this model's "
                                                 "sliding window of 6 positions"):
            state.forward_tree([7] * 7, [-1, 0, 1, 2, 3, 4, 5], 7)
        with pytest.raises(RuntimeError, match="a sliding window of 6 does not span the tree's 7 slots"):
            model.native.ops.tree_attention(  # the kernel's own check
                torch.zeros(7, 4, 16), torch.zeros(2, 32, 16), torch.zeros(2, 32, 16), 14,
                torch.ones(7, 7, dtype=torch.bool), 6, torch.arange(14, 21))


def test_the_soft_cap_kernel_matches_tanh_and_is_batch_invariant():
    """Gemma 2's cap of its logits and scores, lane arithmetic through exp: within 1e-6 of float64's cap tanh(x / cap)
    across its range, and each row of a batch (rows of a ragged length) bit for bit what it gives alone."""
    ops = kernels.load_kernels()
    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(8)) * 60  # [T, V]
    x[0, :7] = torch.tensor([0.0, 1e-6, -1e-6, 500.0, -500.0, 30.0, -30.0])
    capped = ops.softcap(x, 30.0)
    reference = (x.double() / 30.0).tanh() * 30.0
    assert (capped.double() - reference).abs().max() < 1e-5
    assert all(torch.equal(ops.softcap(x[t:t + 1].contiguous(), 30.0), capped[t:t + 1]) for t in range(5))


def test_a_gemma_3_of_one_layer_kind_loads(tmp_path):
    """transformers' Gemma 3 keeps rotary tables only for the layer kinds it has: one of all-local layers (any Gemma
    3 under 6 layers by default) runs natively with its unused full table from the config."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from specdraft.models.native.llama import NativeLlama

    config = Gemma3TextConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                              layer_types=["sliding_attention"] * 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    native = NativeLlama(model)
    assert native.variant.rope_tables == (1, 1)
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([TOKENS])).logits[0]
        got = native.forward(TOKENS, native.new_cache(len(TOKENS)), len(TOKENS))
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


def test_transformers_backend_is_not_batch_invariant_here_negative_control(tiny_native, tiny_dirs):
    """The bitwise check above can fail: the generic forward's multi-row matmuls round differently.
    (If a future torch made this batch invariant, this control would need another witness.)"""
    model = load_model(str(tiny_dirs["target"]), "float32", backend="transformers")
    tokens = TOKENS * 3
    with torch.inference_mode():
        one_pass = model.new_state().forward(tokens, len(tokens))
        state = model.new_state()
        steps = torch.cat([state.forward([t], 1) for t in tokens])
    torch.testing.assert_close(one_pass, steps, atol=1e-4, rtol=0)
    assert not torch.equal(one_pass, steps)


def test_rollback_is_a_length_change_and_growth_keeps_the_cache(tiny_native):
    model = tiny_native["llama", "float32"]
    with torch.inference_mode():
        state = model.new_state(capacity=4)  # forces growth by doubling
        full = state.forward(TOKENS, len(TOKENS))
        assert state.cache.capacity >= len(TOKENS) and state.cache_length == len(TOKENS)
        keys_before = state.cache.keys.data_ptr()
        state.truncate(6)
        assert state.cache_length == 6 and state.cache.keys.data_ptr() == keys_before  # nothing reallocated
        again = state.forward(TOKENS[6:], len(TOKENS) - 6)
    assert torch.equal(again, full[6:])
    assert state.cache_bytes == len(TOKENS) * 2 * model.native.n_kv_heads * model.native.head_dim * 2 * 4


def test_kernels_are_built_with_openmp_and_thread_count_never_changes_a_result(tiny_native):
    """at::parallel_for is sequential unless the extension is compiled with OpenMP: it was, silently, once."""
    model = tiny_native["qwen2", "bfloat16"]
    assert model.native.ops.parallel_backend() == "openmp"
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))  # [T, K]
    weight = torch.randn(1000, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # [N, K]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = model.native.ops.linear(x, weight, None)
        torch.set_num_threads(2)
        two_threads = model.native.ops.linear(x, weight, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one_thread, two_threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_kernel_is_batch_invariant_across_k_blocks_and_tile_shapes(tiny_native, dtype):
    """The tiny models' K (64) fits in one k block; a real model's 1,536 or 8,960 do not. K here spans three
    blocks plus a tail that is not a multiple of 8, and N a partial row group: every token count's tile
    shapes must give each token's row bit for bit what a one-token call gives, and a float64 reference."""
    ops = tiny_native["qwen2", "bfloat16"].native.ops
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(13, 1540, generator=generator)  # [T, K]
    weight = torch.randn(12 * 3 + 5, 1540, generator=generator).to(dtype)  # [N, K]
    bias = torch.randn(12 * 3 + 5, generator=generator)
    one_token = torch.cat([ops.linear(x[t:t + 1].contiguous(), weight, bias) for t in range(13)])  # [T, N]
    x_seen = x.bfloat16() if rounds_activations(dtype) else x
    reference = (x_seen.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(one_token, reference, atol=1e-3, rtol=1e-4)
    for tokens in range(2, 14):
        together = ops.linear(x[:tokens].contiguous(), weight, bias)
        assert torch.equal(together, one_token[:tokens]), f"{tokens} tokens differ from one-token calls"


needs_panels = pytest.mark.skipif(not kernels.load_kernels().dense_panel_rows(),
                                  reason="this build keeps dense matrices in rows (the AVX-512 builds)")


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_panels_match_float64_and_are_batch_invariant(dtype):
    """A dense matrix in panels (a GGUF's F16/BF16/F32 matrices): each token's row bit for bit what a one-token call
    gives, in passes of every tile shape (6 tokens a tile, 1-5 left over), and a float64 reference; one or two
    threads alike."""
    ops = kernels.load_kernels()
    generator = torch.Generator().manual_seed(3)
    rows = 5 * ops.dense_panel_rows()  # 5 panels: the tiles of 4, 3 and 2 panels leave some over
    x = torch.randn(70, 1540, generator=generator)  # [T, K]
    weight = torch.randn(rows, 1540, generator=generator).to(dtype)  # [N, K]
    bias = torch.randn(rows, generator=generator)
    panels = PanelWeight.pack(weight)
    assert isinstance(panels, PanelWeight) and panels.shape == weight.shape and torch.equal(panels.unpack(), weight)
    one_token = torch.cat([panels.linear(x[t:t + 1].contiguous(), bias) for t in range(70)])  # [T, N]
    reference = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(one_token, reference, atol=1e-3, rtol=1e-4)
    for tokens in (*range(2, 17), 64, 65, 70):
        together = panels.linear(x[:tokens].contiguous(), bias)
        assert torch.equal(together, one_token[:tokens]), f"{tokens} tokens differ from one-token calls"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panels.linear(x[:9].contiguous(), bias), one_token[:9])
    finally:
        torch.set_num_threads(before)


@needs_panels
def test_negative_control_panels_read_as_rows_fail_the_same_check():
    """The float64 check above sees the layout: a matrix's rows handed over as if they were panels are far off."""
    ops = kernels.load_kernels()
    generator = torch.Generator().manual_seed(4)
    rows = 2 * ops.dense_panel_rows()
    x, weight = torch.randn(7, 96, generator=generator), torch.randn(rows, 96, generator=generator)
    wrong = weight.reshape(rows // ops.dense_panel_rows(), 96, ops.dense_panel_rows())  # rows, not transposed
    reference = x.double() @ weight.double().T
    assert (ops.linear_panels(x, wrong, None).double() - reference).abs().max() > 1.0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_kernel_matches_a_float64_softmax_and_is_batch_invariant(tiny_native, head_dim):
    """A real model's shape (12 query heads over 2 KV heads) over a long cache whose key counts are not
    multiples of 8 (the kernel scores keys 8 at a time, and attends the queries of a KV head together), with
    peaked and flat score rows: against float64 attention, and every query of a 7-query pass bit for bit what
    a one-query call at its position gives, whatever the thread count."""
    ops = tiny_native["qwen2", "float32"].native.ops
    generator = torch.Generator().manual_seed(3)
    start, queries, heads, kv_heads, capacity = 613, 7, 12, 2, 640
    keys = torch.randn(kv_heads, capacity, head_dim, generator=generator)  # [Hkv, C, Dh]
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    q = torch.randn(queries, heads, head_dim, generator=generator)  # [T, H, Dh]
    q[:, :6] *= 4.0  # the first KV head's queries: peaked softmax rows (score spreads near 90 after scaling)
    together = ops.attention(q, keys, values, start)  # [T, H, Dh]
    group = heads // kv_heads
    for t in range(queries):
        n_keys = start + t + 1
        k64 = keys[:, :n_keys].double().repeat_interleave(group, 0)  # [H, n, Dh]
        v64 = values[:, :n_keys].double().repeat_interleave(group, 0)
        weights = torch.softmax(torch.einsum("hd,hnd->hn", q[t].double(), k64) / head_dim ** 0.5, dim=-1)
        reference = torch.einsum("hn,hnd->hd", weights, v64).float()  # [H, Dh]
        torch.testing.assert_close(together[t], reference, atol=2e-5, rtol=1e-5)
        alone = ops.attention(q[t:t + 1].contiguous(), keys, values, start + t)
        assert torch.equal(alone[0], together[t]), f"query {t} differs from a one-query call"
    before = torch.get_num_threads()
    try:  # the queries of a KV head are split differently per thread count: never a different result
        torch.set_num_threads(1 if before > 1 else 2)
        assert torch.equal(ops.attention(q, keys, values, start), together)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("top_score", [-40.0, -88.5, -88.7, -88.9, -266.2])
def test_attention_kernel_stays_finite_when_every_score_is_far_below_zero(tiny_native, top_score):
    """Every key scored near `top_score` (a query pointing away from all keys; Qwen2's q/k biases make such
    rows). Key counts not a multiple of 8 leave lanes past the end in the last group of 8, scored 0: their weight
    must be 0, not exp(0 - max), whose exponent field overflows near 0 - max = 88.7 or 266 (2^128, 2^384) into an
    inf, times 0 a NaN. NaN logits from position 124 of a real conversation were found this way (2026-12-01)."""
    ops = tiny_native["qwen2", "float32"].native.ops
    generator = torch.Generator().manual_seed(4)
    head_dim, start, queries, heads, kv_heads, capacity = 128, 90, 5, 12, 2, 128
    direction = torch.nn.functional.normalize(torch.randn(head_dim, generator=generator), dim=0)
    q = (48.0 * direction).expand(queries, heads, head_dim).contiguous()  # [T, H, Dh]
    along = top_score * head_dim ** 0.5 / 48.0  # each key's component along the query
    keys = along * direction + 0.01 * torch.randn(kv_heads, capacity, head_dim, generator=generator)  # [Hkv, C, Dh]
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    together = ops.attention(q, keys, values, start)  # [T, H, Dh]
    assert torch.isfinite(together).all()
    group = heads // kv_heads
    for t in range(queries):
        n_keys = start + t + 1
        k64 = keys[:, :n_keys].double().repeat_interleave(group, 0)  # [H, n, Dh]
        scores = torch.einsum("hd,hnd->hn", q[t].double(), k64) / head_dim ** 0.5
        assert abs(scores.max() - top_score) < 0.2
        weights = torch.softmax(scores, dim=-1)
        reference = torch.einsum("hn,hnd->hd", weights, values[:, :n_keys].double().repeat_interleave(group, 0))
        torch.testing.assert_close(together[t], reference.float(), atol=1e-4, rtol=1e-4)


def test_kernels_report_the_instruction_set_they_were_built_for(tiny_native):
    ops = tiny_native["qwen2", "float32"].native.ops
    assert ops.isa() == kernels.chosen_isa() == kernels.startup_info()["isa"]
    assert ops.quant_amx() == (ops.isa() == "amx")  # an AMX build uses its tiles (the OS grants them)


@pytest.mark.parametrize("isa", kernels.runnable_isas())
def test_every_build_this_cpu_can_run_is_batch_invariant(isa):
    """This process has the CPU's best build; the other one (AVX2 on an AVX-512 machine, which is what a user
    gets with SPECDRAFT_KERNELS_ISA=avx2) must pass the same kernel tests: they run again in a child process
    (it builds the other library once, ~30 s, into the same cache)."""
    env = dict(os.environ, **{kernels.ISA_ENV: isa})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "batch_invariant_across_k_blocks or instruction_set_they_were_built_for or bit_for_bit"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_an_unknown_instruction_set_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="use auto, avx2, avx512, avx512bf16"):
        kernels.chosen_isa()


def test_the_build_follows_the_cpu_flags_and_refuses_what_the_cpu_lacks(monkeypatch):
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    cpus = {"avx2": {"avx2", "fma"}, "avx512": avx512, "avx512bf16": avx512 | {"avx512_bf16"},
            "amx": avx512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8"}}
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    for best, flags in cpus.items():
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: flags)
        assert kernels.chosen_isa() == best
        assert kernels.runnable_isas() == list(kernels.ISAS[: kernels.ISAS.index(best) + 1])
    monkeypatch.setattr(kernels, "cpu_flags", lambda: cpus["avx512"])
    monkeypatch.setenv(kernels.ISA_ENV, "avx512bf16")
    with pytest.raises(ValueError, match="lacks \\['avx512_bf16'\\]"):
        kernels.chosen_isa()
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.chosen_isa() == "avx2" and "-mavx512f" not in kernels._flags()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: cpus["avx512bf16"])
    monkeypatch.setenv(kernels.ISA_ENV, "avx512")
    assert "-mavx512f" in kernels._flags() and "-mavx512bf16" not in kernels._flags()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: cpus["amx"])
    monkeypatch.setenv(kernels.ISA_ENV, "avx512bf16")
    assert "-mavx512bf16" in kernels._flags() and "-mamx-int8" not in kernels._flags()
    monkeypatch.delenv(kernels.ISA_ENV)
    assert "-mamx-int8" in kernels._flags() and "-mavx512vnni" in kernels._flags()


def test_long_passes_use_the_matmul_path_and_agree(tiny_native):
    model = tiny_native["qwen2", "float32"]
    tokens = (TOKENS * 5)[: MAX_KERNEL_ROWS + 9]
    with torch.inference_mode():
        prefill = model.new_state().forward(tokens, len(tokens))
        state = model.new_state()
        steps = torch.cat([state.forward([t], 1) for t in tokens])
    torch.testing.assert_close(prefill, steps, atol=1e-4, rtol=0)


def test_greedy_speculation_is_token_identical_in_bf16_too(tiny_native):
    """In bf16 the transformers forward is not batch invariant; the native one is, so greedy speculative
    decoding equals greedy decoding token for token in bf16 as well."""
    target, draft = tiny_native["qwen2", "bfloat16"], tiny_native["llama", "bfloat16"]
    ar = Engine(target, None, SpecConfig("ar"))
    spec = Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4))
    params = SamplingParams(max_new_tokens=40)
    for prompt in ("abc ab", "j. ih", "a"):
        ids = ar.encode(prompt, chat=False)
        expected, got = ar.generate(ids, params), spec.generate(ids, params)
        assert got.token_ids == expected.token_ids
        assert got.stats.backend == "native" and got.stats.drafter["draft_backend"] == "native"


def _unsupported_model_dir(tmp_path):
    path = build_model(tmp_path / "gelu", seed=6)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["hidden_act"] = "gelu"
    config_file.write_text(json.dumps(config))
    return path


def test_auto_falls_back_to_transformers_and_says_why(tmp_path):
    model = load_model(str(_unsupported_model_dir(tmp_path)), "float32")
    assert model.backend == "transformers" and "gelu" in model.backend_note
    assert native_unsupported_reason(model.model) == model.backend_note
    result = Engine(model, None, SpecConfig("ar")).generate([3, 4, 5], SamplingParams(max_new_tokens=3))
    assert result.stats.backend == "transformers"


def test_a_long_rope_model_serves_its_original_context_and_a_draft_of_it_limits_the_request(tiny_native):
    """Natively a long-RoPE model (the tiny Phi-3: long RoPE past 256 of its 512 positions) takes 256 positions, as
    target or as draft model: a request past them is one clear error naming whose context, before any pass."""
    phi3, qwen2 = tiny_native["phi3", "float32"], tiny_native["qwen2", "float32"]
    assert phi3.max_positions == 256 and qwen2.max_positions == 512
    params = SamplingParams(max_new_tokens=60)
    prompt = [3, 4, 5] * 70  # 210 tokens: 270 positions with the new ones
    with pytest.raises(SpecdraftError, match="the model's context of 256"):
        Engine(phi3, None, SpecConfig("ar")).generate(prompt, params)
    with pytest.raises(SpecdraftError, match="the draft model's context of 256"):
        Engine(qwen2, ModelDrafter(phi3, qwen2), SpecConfig("draft", 4)).generate(prompt, params)
    engine = Engine(qwen2, ModelDrafter(phi3, qwen2), SpecConfig("draft", 4))
    assert engine.max_positions == 256  # (what the server's default max_tokens leaves room for)
    engine.generate(prompt, SamplingParams(max_new_tokens=40))  # 250 positions: served


def test_a_target_token_the_draft_model_lacks_is_read_as_its_id_0_and_the_output_stays_exact(tmp_path, monkeypatch):
    """A target whose vocabulary extends the draft's (here 20 ids against 14): a prompt or an output holding an id
    past the draft's embedding reaches the draft model as its id 0 (HasDraftVocab.readable), and speculation gives
    plain decoding's tokens, chain and tree alike. Without that mapping the draft model's lookup fails (control)."""
    from specdraft.drafters import TreeDrafter
    from specdraft.drafters.vocab import HasDraftVocab

    target = load_model(str(build_model(tmp_path / "wide", seed=7, vocab_size=20, hidden=64)), "float32",
                        backend="native")
    draft = load_model(str(build_model(tmp_path / "narrow", seed=8, hidden=64, arch="llama")), "float32",
                       backend="native")
    assert (target.vocab_size, draft.vocab_size) == (20, 14)
    prompt, params = [3, 17, 4, 5, 18, 6, 3, 17, 4], SamplingParams(max_new_tokens=24)
    plain = Engine(target, None, SpecConfig("ar")).generate(prompt, params).token_ids
    for drafter, spec in ((ModelDrafter(draft, target), SpecConfig("draft", 4)),
                          (TreeDrafter(draft, target, budget=8, depth=3, branch=2), SpecConfig("draft-tree"))):
        assert Engine(target, drafter, spec).generate(prompt, params).token_ids == plain
    monkeypatch.setattr(HasDraftVocab, "readable", lambda self, ids: ids)
    with pytest.raises((RuntimeError, IndexError)):
        Engine(target, ModelDrafter(draft, target), SpecConfig("draft", 4)).generate(prompt, params)


def test_which_sliding_windows_run_natively():
    """Mistral's window applies whenever its config names one (on every layer), Gemma's on its local layers, Qwen's
    only with `use_sliding_window` (on the layers from `max_window_layers` on): all run natively."""
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                              SmolLM3Config)

    from specdraft.models.native.llama import config_unsupported_reason, model_variant

    for config in (MistralConfig(sliding_window=4096), MistralConfig(sliding_window=None),
                   Qwen3Config(sliding_window=4096), Qwen2Config(), Gemma3TextConfig(num_hidden_layers=6)):
        assert config_unsupported_reason(config) is None
    assert model_variant(MistralConfig(sliding_window=4096, num_hidden_layers=2)).windows == (4096, 4096)
    assert model_variant(MistralConfig(sliding_window=None, num_hidden_layers=2)).windows == (0, 0)
    assert model_variant(Gemma3TextConfig(num_hidden_layers=6)).windows == (4096,) * 5 + (0,)
    qwen3 = Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=2, num_hidden_layers=4)
    assert config_unsupported_reason(qwen3) is None and model_variant(qwen3).windows == (0, 0, 64, 64)
    assert model_variant(Qwen3Config(sliding_window=64, num_hidden_layers=2)).windows == (0, 0)  # not turned on
    # transformers' Llama has no window: a Llama config naming sliding layers stays off the backend
    assert "sliding-window" in config_unsupported_reason(LlamaConfig(
        num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=64))
    assert "bidirectional" in config_unsupported_reason(Gemma3TextConfig(use_bidirectional_attention=True))
    # SmolLM3: every 4th layer without RoPE (a table of no rotation), its window only where it is turned on
    smollm3 = SmolLM3Config(num_hidden_layers=8)
    assert config_unsupported_reason(smollm3) is None
    assert model_variant(smollm3).rope_tables == (0, 0, 0, 1) * 2 and model_variant(smollm3).windows == (0,) * 8
    windowed = SmolLM3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64)
    assert model_variant(windowed).windows == (0, 0, 0, 64)
    # Phi-3: its window (Phi-3-mini-4k's 2047) on every layer, as transformers applies it
    phi3 = Phi3Config(num_hidden_layers=2, sliding_window=2047)
    assert config_unsupported_reason(phi3) is None and model_variant(phi3).windows == (2047, 2047)


def test_forcing_native_on_an_unsupported_model_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdraftError, match="cannot use the native backend: activation 'gelu'"):
        load_model(str(_unsupported_model_dir(tmp_path)), "float32", backend="native")
    with pytest.raises(SpecdraftError, match="unknown backend"):
        load_model(str(_unsupported_model_dir(tmp_path)), "float32", backend="fast")


def test_auto_dtype_gives_the_native_backend_bf16_weights(tiny_dirs):
    from specdraft.config import cpu_has_native_bf16

    native = load_model(str(tiny_dirs["target"]), "auto")
    assert native.backend == "native" and native.dtype == torch.bfloat16
    gate = native.native.layers[0].gate
    assert gate.dtype == torch.bfloat16
    if kernels.load_kernels().dense_panel_rows():  # in panels: taken from the transformers model, which is let go
        assert isinstance(gate, PanelWeight) and native.model is None and native.native.transformers_spent
        again = native.transformers_model("a transformers forward")  # loaded again from the folder, once
        assert again is native.transformers_model("another") and torch.equal(
            again.model.layers[0].mlp.gate_proj.weight, gate.unpack())
    else:  # shared with the transformers model, not copied
        assert gate.data_ptr() == native.model.model.layers[0].mlp.gate_proj.weight.data_ptr()
    generic = load_model(str(tiny_dirs["target"]), "auto", backend="transformers")
    assert generic.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def test_rotary_tables_grown_in_steps_equal_tables_grown_at_once(tiny_native):
    """Rotary rows come in fixed blocks of positions: the tables a long generation grows to hold, bit for bit, what
    a fresh model computing them in one go holds (so a run's history never changes a position's rotation)."""
    from specdraft.models.native import llama

    native = tiny_native["gemma3", "float32"].native  # two tables: its full layers' and its local ones'
    stepped, at_once = copy.copy(native), copy.copy(native)
    stepped.max_positions = at_once.max_positions = 5000
    for table in (stepped, at_once):
        table.cos_tables = table.sin_tables = [torch.empty(0, native.head_dim)] * 2
    for n in (10, llama.ROTARY_ROWS + 1, 2500, 4999):
        stepped._cover_positions(n)
    at_once._cover_positions(5000)
    for index in range(2):
        assert stepped.cos_tables[index].shape[0] == at_once.cos_tables[index].shape[0] == 5000
        assert torch.equal(stepped.cos_tables[index], at_once.cos_tables[index])
        assert torch.equal(stepped.sin_tables[index], at_once.sin_tables[index])
    assert not torch.equal(at_once.cos_tables[0], at_once.cos_tables[1])


def layer_by_layer(native, token_ids: list[int], cache) -> torch.Tensor:
    """Logits of every new token, the layers driven one by one from Python (`layer_forward`)."""
    start = cache.length
    cache.reserve(start + len(token_ids))
    hidden = native.embed_tokens(token_ids)
    for index in range(len(native.layers)):
        hidden = native.layer_forward(index, hidden, cache, start)
    cache.length = start + len(token_ids)
    return native.logits(hidden)


@pytest.fixture(scope="module")
def stack_models(tiny_native, tmp_path_factory):
    """Dense float32/bf16 models and GGUF ones (Q8_0 with Q4_1, interleaved and not; Q5_0; F16 in panels), biases
    included."""
    from tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("stack")
    models = {f"{arch}-{dtype}": model for (arch, dtype), model in tiny_native.items()}
    for arch, qtype, mixed in (("qwen2", "Q8_0", "Q4_1"), ("llama", "Q5_0", None), ("qwen3", "Q8_0", None),
                               ("qwen2", "F16", None), ("gemma3", "Q8_0", None), ("phi3", "Q8_0", "Q4_1")):
        hf = build_model(root / f"hf-{arch}-{qtype}", seed=31, arch=arch, hidden=64, layers=2)
        path = write_gguf(hf, root / "cache", f"stack-{arch}-{qtype}", qtype, mixed)
        models[f"{arch}-{qtype}"] = load_model(str(path), "gguf", progress=False)
    return models


@pytest.mark.parametrize("name", ["qwen2-float32", "qwen2-bfloat16", "llama-float32", "llama-bfloat16",
                                  "qwen3-float32", "qwen2-Q8_0", "llama-Q5_0", "qwen3-Q8_0", "qwen2-F16",
                                  "gemma2-float32", "gemma3-bfloat16", "gemma3-Q8_0", "phi3-bfloat16", "phi3-Q8_0"])
def test_the_layer_stack_gives_the_bits_of_the_layers_run_one_by_one(stack_models, name, monkeypatch):
    """A chain pass runs every layer in one kernel call (ops.LayerStack); a token tree and feature taps still drive
    the layers from Python. Both give the same logits and the same cached K/V, bit for bit, for one sequence
    (prefill, a step, a verify pass) and for several in one pass (forward_many)."""
    from specdraft.models.native.llama import NativeLlama

    native = stack_models[name].native
    with torch.inference_mode():
        reference_caches, references = [], []
        for prompt in (TOKENS, TOKENS[3:9]):
            cache = native.new_cache(8)  # grows during the passes
            references.append([layer_by_layer(native, ids, cache) for ids in (prompt, [5], [6, 7, 8])])
            reference_caches.append(cache)
        # the stack path must not fall back to the Python layers
        monkeypatch.setattr(NativeLlama, "_layer", lambda *args, **kwargs: pytest.fail("a layer ran in Python"))
        for prompt, expected, reference_cache in zip((TOKENS, TOKENS[3:9]), references, reference_caches):
            cache = native.new_cache(8)
            got = [native.forward(ids, cache, len(ids)) for ids in (prompt, [5], [6, 7, 8])]
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            n = cache.length
            assert torch.equal(cache.keys[:, :, :n], reference_cache.keys[:, :, :n])
            assert torch.equal(cache.values[:, :, :n], reference_cache.values[:, :, :n])
        first, second = native.new_cache(8), native.new_cache(8)
        native.forward_many([(TOKENS, first, 1), (TOKENS[3:9], second, 1)])
        together = native.forward_many([([5], first, 1), ([5], second, 1)])
        assert torch.equal(together[0], references[0][1]) and torch.equal(together[1], references[1][1])
        together = native.forward_many([([6, 7, 8], first, 3), ([6, 7, 8], second, 2)])
        assert torch.equal(together[0], references[0][2]) and torch.equal(together[1], references[1][2][1:])


def test_a_pass_on_another_thread_than_the_loading_one_warns_once(tiny_dirs, monkeypatch):
    """With several torch threads, passes on a thread other than the loading one are slow (each thread that starts
    OpenMP regions gets its own team): the model says so once, and never on the loading thread."""
    import threading
    import warnings

    model = load_model(str(tiny_dirs["target"]), "float32", backend="native")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the tests run one torch thread
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.new_state().forward([3, 4, 5], 1)
        assert not caught
        for _ in range(2):
            thread = threading.Thread(target=lambda: model.new_state().forward([3, 4, 5], 1))
            thread.start()
            thread.join()
    assert len([w for w in caught if "another thread" in str(w.message)]) == 1
