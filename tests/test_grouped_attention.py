"""Grouped-query attention for batched decoding (models/grouped_attention.py) against transformers' sdpa."""

from __future__ import annotations

import pytest
import torch

from tiny import build_model


@pytest.fixture(scope="module")
def two_loads(tmp_path_factory):
    """The same tiny GQA model (4 query heads over 2 KV heads) loaded twice: sdpa and grouped attention."""
    from specdraft import load_model
    from specdraft.models.grouped_attention import use_grouped_attention

    path = build_model(tmp_path_factory.mktemp("grouped") / "m", seed=5, layers=2)
    stock = load_model(str(path), dtype="float32", backend="transformers")
    grouped = load_model(str(path), dtype="float32", backend="transformers")
    use_grouped_attention(grouped.model)
    assert stock.model.config._attn_implementation == "sdpa"
    return stock, grouped


def _decode(loaded, prompts: list[list[int]], steps: torch.Tensor, padded: bool) -> torch.Tensor:
    """Prefill (left-padded when `padded`), then one token per row per step -> logits [1 + steps, rows, V]."""
    from specdraft.models.batched import BatchDecoder

    width = max(map(len, prompts))
    ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])  # [rows, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [rows, width]
    decoder = BatchDecoder(loaded)
    logits = []
    with torch.inference_mode():
        if padded:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits.append(decoder.forward(ids, mask, positions))
            for step in steps:  # step [rows]
                mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
                logits.append(decoder.forward(step[:, None], mask, (mask.sum(-1, keepdim=True) - 1)))
        else:
            logits.append(decoder.forward(ids))
            logits.extend(decoder.forward(step[:, None]) for step in steps)
    return torch.stack(logits)


def test_grouped_decoding_equals_sdpa_with_and_without_padding(two_loads):
    stock, grouped = two_loads
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 14, (n,), generator=generator).tolist() for n in (9, 3, 6, 1)]
    steps = torch.randint(2, 14, (5, len(prompts)), generator=generator)  # [steps, rows]
    same_length = [p[:1] + prompts[0][1:] for p in prompts]  # no padding: the unmasked path
    for batch, padded in ((prompts, True), (same_length, False)):
        expected = _decode(stock, batch, steps, padded)
        got = _decode(grouped, batch, steps, padded)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # negative control: the padded prompts differ from the unpadded ones if the mask is dropped, so the padded
    # comparison above did test the mask
    unmasked = _decode(grouped, prompts, steps, padded=False)
    assert not torch.allclose(unmasked[1:, 1], _decode(stock, prompts, steps, padded=True)[1:, 1], atol=1e-3)


def test_grouped_attention_matches_sdpa_on_crafted_tensors():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdraft.models.grouped_attention import grouped_attention

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 1, 8, generator=generator)  # [B, Hq, 1, D]
    key, value = (torch.randn(2, 2, 5, 8, generator=generator) for _ in range(2))  # [B, Hkv, L, D]
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.bool)[:, None, None]  # [B, 1, 1, L]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # [B, 1, 1, L]
    for attention_mask in (mask, additive, None):
        expected, _ = sdpa_attention_forward(Attention(), query, key, value, attention_mask, scaling=0.3)
        got, _ = grouped_attention(Attention(), query, key, value, attention_mask, scaling=0.3)
        assert got.shape == (2, 1, 6, 8)
        torch.testing.assert_close(got, expected)
    # a row that sees no key gets the average of the values (never NaN), as an additive-minimum mask gives
    nothing = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    got, _ = grouped_attention(Attention(), query, key, value, nothing)
    assert torch.isfinite(got).all()
