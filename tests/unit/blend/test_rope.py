"""``RopeShift``: moving stored K is exact for RoPE types with fixed
frequencies (checked against the model's own rotary embedding at the new
positions), round-trips, and is refused where it would not be exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvtier.blend import RopeShift
from tests.hf_helpers import prompt, tiny_model

ROPES: dict[str, dict[str, Any]] = {
    "default": {},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    },
    "yarn": {  # a constant attention factor: already inside the stored K
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
    },
}


def layer_keys(model: Any, tokens: list[int], start: int) -> torch.Tensor:
    """Every layer's K for ``tokens`` placed at positions ``start ..``."""
    cache = DynamicCache()
    positions = torch.arange(start, start + len(tokens))[None]
    with torch.inference_mode():
        model(torch.tensor([tokens]), past_key_values=cache, use_cache=True, position_ids=positions)
    return cache.layers[0].keys


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_moved_keys_equal_keys_computed_at_the_new_place(rope: str) -> None:
    model = tiny_model("llama", **ROPES[rope])
    shift = RopeShift.of(model)
    assert shift.rope_type == rope
    tokens = prompt(1, 48)
    at_zero = layer_keys(model, tokens, 0)
    for offset in (1, 37, 300):
        moved = shift.rotate(at_zero, offset)
        expected = layer_keys(model, tokens, offset)
        assert (moved - expected).abs().max().item() <= 2e-5, (rope, offset)
    assert (shift.rotate(at_zero, 300) - at_zero).abs().max().item() > 0.1  # it did move


def test_the_move_round_trips() -> None:
    shift = RopeShift.of(tiny_model("llama"))
    keys = torch.randn(3, 1, 2, 50, 32)
    back = shift.rotate(shift.rotate(keys, 1234), -1234)
    assert (back - keys).abs().max().item() <= 1e-5
    assert torch.equal(shift.rotate(keys, 0), keys)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "sequence length"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 16,
                "long_factor": [2.0] * 16,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
            "short and long",
        ),
    ],
)
def test_rope_types_whose_move_is_not_exact_are_refused(
    parameters: dict[str, Any], says: str
) -> None:
    model = tiny_model("llama", rope_parameters=parameters)
    with pytest.raises(ValueError, match=says):
        RopeShift.of(model)


def test_a_model_without_rope_is_refused() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="no rotary position embedding"):
        RopeShift.of(model)
