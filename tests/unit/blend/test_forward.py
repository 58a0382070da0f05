"""``blend_forward``'s attention probe: what the ``impact`` selection ranks by
is the attention the model itself pays, and the model is left as it was;
``prefix_attention`` computes what one SDPA call over every key does."""

from __future__ import annotations

import pytest
import torch

from kvtier.blend import BlendConfig, Selector, blend_forward
from kvtier.blend.forward import QUERIES_AT_ONCE, attention_mask, prefix_attention
from tests.hf_helpers import tiny_model


class _Recording(Selector):
    """A selector that keeps what ``after`` was given, per layer."""

    seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]]

    def after(
        self,
        layer: int,
        positions: torch.Tensor,
        deviation: torch.Tensor,
        attention: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.seen[layer] = (positions.clone(), attention)
        return super().after(layer, positions, deviation, attention)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_probe_reads_the_attention_the_question_pays(implementation: str) -> None:
    model = tiny_model("llama", num_hidden_layers=4)
    model.set_attn_implementation(implementation)
    total, question = 60, list(range(52, 60))
    ids = torch.randint(0, 512, (total,), generator=torch.Generator().manual_seed(3))
    computed = torch.zeros(total, dtype=torch.bool)
    computed[question] = True
    candidates = torch.zeros(total, dtype=torch.bool)
    candidates[10:52] = True
    config = BlendConfig(ratio=0.3, selection="impact", check_layer=1, filter_layers=1)
    selector = _Recording(config, 4, computed, candidates, [(10, 52)])
    selector.seen = {}
    layers, heads, dim = 4, 2, 32
    keys = [torch.randn(1, heads, total, dim) for _ in range(layers)]  # stale: overwritten
    values = [torch.randn(1, heads, total, dim) for _ in range(layers)]
    blend_forward(model, ids, keys, values, selector)

    # Up to the check layer every position runs, so layer 1's attention is full prefill's.
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        weights = model(ids[None], output_attentions=True).attentions[1][0]  # [heads, N, N]
    expected = weights[:, question].mean(dim=(0, 1))
    positions, attention = selector.seen[1]
    assert positions.tolist() == list(range(total))
    assert attention is not None
    assert torch.allclose(attention, expected, atol=1e-5)
    assert attention[52:].sum() > 0 and abs(float(attention.sum()) - 1.0) < 1e-4
    # one layer on, only the kept positions ran: the probe covers those
    positions, attention = selector.seen[2]
    assert attention is not None and attention.shape == positions.shape
    assert model.config._attn_implementation == "eager"  # restored after each pass


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_question_selection_reads_what_the_question_attends_to_in_the_later_layers(
    implementation: str,
) -> None:
    """With every stored K/V exact (full prefill's), the first pass (the
    question alone over them) reads full prefill's own attention rows, the
    candidates it reads most are recomputed, and the result is full prefill's."""
    model = tiny_model("llama", num_hidden_layers=4)
    total, question = 60, list(range(52, 60))
    ids = torch.randint(0, 512, (total,), generator=torch.Generator().manual_seed(5))
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        full = model(ids[None], output_attentions=True, use_cache=True)
    expected = torch.stack([full.attentions[n][0][:, question].mean(dim=(0, 1)) for n in (2, 3)])
    expected = expected.mean(dim=0)  # read_from 0.5 of 4 layers: layers 2 and 3
    keys = [layer.keys.clone() for layer in full.past_key_values.layers]
    values = [layer.values.clone() for layer in full.past_key_values.layers]
    computed = torch.zeros(total, dtype=torch.bool)
    computed[question] = True
    candidates = torch.zeros(total, dtype=torch.bool)
    candidates[10:52] = True
    model.set_attn_implementation(implementation)
    selector = Selector(BlendConfig(ratio=0.25), 4, computed, candidates, [(10, 52)])
    out = blend_forward(model, ids, keys, values, selector)

    assert selector.reading is not None
    assert torch.allclose(selector.reading, expected, atol=1e-5)
    chosen = torch.topk(expected[10:52], round(0.25 * 42)).indices + 10
    assert selector.initial().tolist() == sorted(chosen.tolist()) + question
    assert out.layer_tokens == [len(chosen) + len(question)] * 4  # every layer, from layer 0
    assert out.reading_tokens == 4 * len(question)
    assert torch.allclose(out.logits, full.logits[0, -1], atol=1e-4)


def test_the_model_is_left_as_it_was_when_a_layer_fails() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    before = model.config._attn_implementation
    total = 20
    computed = torch.zeros(total, dtype=torch.bool)
    computed[-2:] = True
    candidates = ~computed
    candidates[:4] = False
    selector = Selector(BlendConfig(ratio=0.5), 2, computed, candidates, [(4, 18)])
    bad_keys = [torch.zeros(1, 2, total - 1, 32) for _ in range(2)]  # one position short
    values = [torch.zeros(1, 2, total, 32) for _ in range(2)]
    with pytest.raises(IndexError):
        blend_forward(model, torch.arange(total), bad_keys, values, selector)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("mask_mode", ["exact", "bottom_right"])
@pytest.mark.parametrize("selected", [1, QUERIES_AT_ONCE, QUERIES_AT_ONCE + 1, 150, 300])
def test_prefix_attention_equals_one_sdpa_over_every_key(mask_mode: str, selected: int) -> None:
    total, heads, kv_heads, dim = 300, 6, 2, 16
    generator = torch.Generator().manual_seed(selected)
    picked = torch.randperm(total - 1, generator=generator)[: selected - 1]
    positions = torch.cat([picked.sort().values, torch.tensor([total - 1])])
    query = torch.randn(1, heads, selected, dim, generator=generator)
    keys = torch.randn(1, kv_heads, total, dim, generator=generator)
    values = torch.randn(1, kv_heads, total, dim, generator=generator)
    mask = attention_mask(positions, total, mask_mode, torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    got = prefix_attention(query, keys, values, mask, 0.3)
    assert torch.allclose(got, expected, atol=1e-5)


def test_prefix_attention_without_a_mask_is_causal() -> None:
    query = torch.randn(1, 4, 90, 8)
    keys, values = torch.randn(1, 4, 90, 8), torch.randn(1, 4, 90, 8)
    mask = attention_mask(torch.arange(90), 90, "exact", torch.float32)
    expected = prefix_attention(query, keys, values, mask, 0.5)
    assert torch.allclose(prefix_attention(query, keys, values, None, 0.5), expected, atol=1e-5)
