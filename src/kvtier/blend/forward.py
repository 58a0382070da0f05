"""The blended forward pass: each layer runs only the positions the
``Selector`` picks, over every position's K and V.

The model's own decoder layers do the work (norms, projections, RoPE,
attention, MLP), called with the selected positions' hidden states, their
position ids and an explicit attention mask over all ``N`` positions. In
place of a KV cache each layer gets a ``_Scatter``: when the attention hands
it the new K and V, it measures how far they are from what the layer held
there (the deviation the selection ranks by), writes them in at their
positions and returns the layer's whole K and V. So a recomputed token
attends to the stored KV of the others and the fresh KV of its fellows, and
what the layers hold at the end is an ordinary cache to generate from.

Masks over the ``N`` keys for the ``S`` selected queries (sorted positions
``p``): ``exact``, key ``j`` visible to query ``i`` iff ``j <= p_i``;
``bottom_right``, iff ``j <= N - S + i`` (a causal mask aligned to the last
key, as a prefill kernel given S new tokens over N cached ones applies it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.blend.select import Selector

CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers >= 5.24, then 5.19-5.23


def cache_keyword(function: Callable[..., Any], owner: str) -> str:
    """The name ``function`` takes its KV cache by (``CACHE_ARGUMENTS``)."""
    parameters = inspect.signature(function).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(
        f"{owner}.forward takes neither of {CACHE_ARGUMENTS}; install a transformers release "
        "in the range kvtier's pyproject.toml pins"
    )


@dataclass(slots=True)
class BlendPass:
    """What the pass computed: the last position's logits, every layer's K
    and V (``[1, kv_heads, N, head_dim]``) and how many positions each layer ran."""

    logits: torch.Tensor  # [vocab], float32
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    layer_tokens: list[int]


class _Scatter:
    """A layer's stand-in cache (see the module docstring)."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: torch.Tensor,
        measure: bool,
    ) -> None:
        self.keys, self.values = keys, values
        self.positions = positions
        self.measure = measure
        self.deviation: torch.Tensor | None = None  # [S]: |dK|^2 + |dV|^2 per position

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.measure:
            old_k = keys.index_select(2, self.positions)
            old_v = values.index_select(2, self.positions)
            dk = (key_states.float() - old_k.float()).pow(2).sum(dim=(0, 1, 3))
            dv = (value_states.float() - old_v.float()).pow(2).sum(dim=(0, 1, 3))
            self.deviation = dk + dv
        keys.index_copy_(2, self.positions, key_states.to(keys.dtype))
        values.index_copy_(2, self.positions, value_states.to(values.dtype))
        return keys, values


def attention_mask(
    positions: torch.Tensor, total: int, mode: str, dtype: torch.dtype, causal: bool = False
) -> torch.Tensor | None:
    """The additive ``[1, 1, S, N]`` mask for queries at ``positions``; None
    when every position runs and ``causal`` says the attention applies the
    causal mask itself when given none (SDPA's fast path)."""
    if causal and positions.numel() == total:
        return None  # both masks are the plain causal one then
    keys = torch.arange(total)
    if mode == "exact":
        last = positions
    else:  # bottom_right
        last = total - positions.numel() + torch.arange(positions.numel())
    allowed = keys[None, :] <= last[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def blend_forward(
    model: Any,
    ids: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    selector: Selector,
    mask: str = "exact",
) -> BlendPass:
    """Run ``model`` over the prompt ``ids`` (``[N]``) with every layer's K and
    V preloaded in ``keys``/``values`` (the stored ones at reused positions;
    overwritten in place where a layer runs a position). The last position
    must be one ``selector`` always computes."""
    decoder = model.model
    layers = decoder.layers
    keyword = cache_keyword(layers[0].forward, type(layers[0]).__name__)
    total = int(ids.numel())
    positions = selector.initial()
    if positions.numel() == 0 or int(positions[-1]) != total - 1:
        raise ValueError("the blend must compute the last prompt token (it gives the logits)")
    hidden = decoder.embed_tokens(ids[positions][None])
    rope = decoder.rotary_emb(hidden, positions[None])
    causal = getattr(model.config, "_attn_implementation", "") == "sdpa"
    mask_tensor = attention_mask(positions, total, mask, hidden.dtype, causal)
    layer_tokens = []
    for n, layer in enumerate(layers):
        narrows = selector.narrows_after(n)
        scatter = _Scatter(keys, values, positions, measure=narrows)
        out = layer(
            hidden,
            attention_mask=mask_tensor,
            position_ids=positions[None],
            position_embeddings=rope,
            use_cache=True,
            **{keyword: scatter},
        )
        hidden = out[0] if isinstance(out, tuple) else out
        layer_tokens.append(int(positions.numel()))
        if narrows:
            assert scatter.deviation is not None
            keep = selector.after(n, positions, scatter.deviation)
            if keep.numel() != positions.numel():
                positions, hidden = positions[keep], hidden[:, keep]
                rope = tuple(t[:, keep] for t in rope)
                mask_tensor = attention_mask(positions, total, mask, hidden.dtype, causal)
    last = decoder.norm(hidden[:, -1:])
    logits: torch.Tensor = model.lm_head(last)[0, -1].float()
    return BlendPass(logits, keys, values, layer_tokens)


__all__ = [
    "CACHE_ARGUMENTS",
    "BlendPass",
    "attention_mask",
    "blend_forward",
    "cache_keyword",
]
