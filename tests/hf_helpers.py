"""Shared by the transformers-integration tests (``tests/unit/engine``,
``tests/integration/test_hf_reuse.py`` and ``tests/integration/hf_peer.py``):
tiny random-weight models, seeded prompts, the one output comparison every
reuse test makes, and a ``CacheLink`` wrapper that tests subclass to tamper
with a link.

Models are fp32, two layers, GQA (4 query heads, 2 KV heads of dim 32) and a
512-token vocabulary: a prefill of 100 tokens takes milliseconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvtier.engine.link import CacheLink, Hit
from kvtier.protocol.client import Consume, Fill

TOLERANCE = 1e-4  # max |Δlogit| against the no-cache reference
VOCAB = 512
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Sliding windows shorter than the test prompts, so that the window is applied
# (kvtier keeps sliding-window layers whole; the attention mask does the rest).
# Qwen2 gets one full and one sliding layer.
FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    ),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 24}),
}


def tiny_config(family: str = "llama", **overrides: Any) -> PretrainedConfig:
    config_class, _, extra = FAMILIES[family]
    return config_class(**{**TINY, **extra, **overrides})


def tiny_model(family: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random-weight fp32 model in eval mode; the same arguments give the same weights."""
    _, model_class, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model: PreTrainedModel = model_class(tiny_config(family, **overrides))
    return model.eval()


def prompt(seed: int, tokens: int, vocab: int = VOCAB) -> list[int]:
    """``tokens`` token ids drawn from ``seed``."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, tokens)]


class Output(Protocol):
    """What a generation is compared on (``Generation`` has both)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def logits(self) -> torch.Tensor: ...


def max_logit_diff(ref: Output, got: Output) -> float:
    return float((got.logits - ref.logits).abs().max())


def assert_same_output(ref: Output, got: Output, tolerance: float = TOLERANCE) -> None:
    """The same greedy tokens, and every step's logits within ``tolerance``."""
    assert got.tokens == ref.tokens, f"greedy tokens differ: {got.tokens} != {ref.tokens}"
    assert got.logits.shape == ref.logits.shape, (got.logits.shape, ref.logits.shape)
    diff = max_logit_diff(ref, got)
    assert diff <= tolerance, f"max |Δlogit| {diff:.3g} > {tolerance:g}"


class DelegatingLink:
    """A ``CacheLink`` that passes every call on to ``inner``; subclasses
    override what they tamper with (``engine.link = Sub(engine.link)``)."""

    def __init__(self, inner: CacheLink | None) -> None:
        assert inner is not None, "the engine has no link"
        self.inner = inner

    @property
    def chunk_size(self) -> int | None:
        return self.inner.chunk_size

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        return self.inner.lookup(request_id, hashes)

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        return self.inner.load(request_id, start, end, consume)

    def release(self, request_id: str, start: int, end: int) -> None:
        self.inner.release(request_id, start, end)

    def store(self, request_id: str, hashes: Sequence[bytes], object_bytes: int, fill: Fill) -> int:
        return self.inner.store(request_id, hashes, object_bytes, fill)

    def end(self, request_id: str) -> None:
        self.inner.end(request_id)

    def report_shadow(self, checked: int, mismatched: int) -> None:
        self.inner.report_shadow(checked, mismatched)

    def report_quality(self, path: str, agreed: bool, kl: float, off: bool) -> None:
        self.inner.report_quality(path, agreed, kl, off)

    def pin(self, hashes: Sequence[bytes], ttl_s: float) -> int:
        return self.inner.pin(hashes, ttl_s)

    def report_usage(
        self, prefill_s: float, computed_tokens: int, load_s: float, loaded_tokens: int
    ) -> None:
        self.inner.report_usage(prefill_s, computed_tokens, load_s, loaded_tokens)

    def close(self) -> None:
        self.inner.close()


class PerturbingLink(DelegatingLink):
    """Hands the engine a copy of each loaded object with ``delta`` added to
    every value (as float32) of the chunks in ``chunks`` (all if None)."""

    def __init__(
        self, inner: CacheLink | None, delta: float, chunks: Sequence[int] | None = None
    ) -> None:
        super().__init__(inner)
        self.delta = delta
        self.chunks = chunks
        self.perturbed = 0

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        def perturbed(i: int, view: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
            if self.chunks is not None and start + i not in self.chunks:
                consume(i, view)
                return
            copy = view.copy()
            copy.view(np.float32)[:] += np.float32(self.delta)
            self.perturbed += 1
            consume(i, copy)

        return self.inner.load(request_id, start, end, perturbed)
