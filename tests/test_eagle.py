"""EAGLE-3-style head: feature taps, lossless drafting (greedy and sampled), training resume, export round trip."""

from __future__ import annotations

import pytest
import torch

from specdraft import SpecdraftError, load_model

TOKENS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


# ------------------------------------------------------------------------------------------------ feature taps

@pytest.mark.parametrize("layers", [(0, 1, 2), (1,), (2, 0)])
def test_feature_taps_equal_transformers_output_hidden_states(tiny_models, layers):
    model = tiny_models["target"]
    with torch.inference_mode():
        reference = model.model(input_ids=torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
        state = model.new_state(feature_layers=layers)
        state.forward(TOKENS[:6], 1)
        first = state.features  # [6, n_taps, D]
        state.forward(TOKENS[6:], 2)
        second = state.features  # [4, n_taps, D]
    expected = torch.stack([reference[i][0] for i in layers], dim=1)  # [10, n_taps, D]
    got = torch.cat([first, second])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_feature_taps_equal_on_both_backends(tiny_dirs):
    layers = (0, 1, 2)
    native = load_model(str(tiny_dirs["target"]), "float32", backend="native")
    hf = load_model(str(tiny_dirs["target"]), "float32", backend="transformers")
    with torch.inference_mode():
        taps = []
        for model in (native, hf):
            state = model.new_state(feature_layers=layers)
            state.forward(TOKENS[:7], 1)
            state.truncate(5)
            state.forward(TOKENS[5:], 3)
            taps.append(state.features)
    assert taps[0].shape == (5, 3, native.hidden_size)
    torch.testing.assert_close(taps[0], taps[1], rtol=1e-4, atol=1e-4)


def test_no_taps_requested_means_no_features(tiny_models):
    state = tiny_models["target"].new_state()
    with torch.inference_mode():
        state.forward(TOKENS[:3], 1)
    assert state.features is None


def test_feature_layer_out_of_range_is_a_user_error(tiny_models):
    with pytest.raises(SpecdraftError, match="outside"):
        tiny_models["target"].new_state(feature_layers=(0, 3))
