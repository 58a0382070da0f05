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

The ``impact`` selection also needs the attention the computed positions
(the question) pay every position, which only the attention itself sees
(its queries are rotated, normed and split into heads inside it). Each
layer's attention gets the ``_Scatter`` as ``kvtier_probe`` and hands it
its queries (``_Scatter.observe``): a transformers model through an
attention function registered with transformers' ``AttentionInterface``
(``probing_attention``, which wraps the model's own, set for the length of
the pass), a vLLM model (``kvtier.engine.vllm.blend_model``) in its own
layer code.

Where the model's attention is SDPA, the pass runs ``prefix_attention``
instead: the same numbers, without scoring the keys the mask hides from
each selected query (PyTorch's CPU kernel scores every key an explicit mask
covers).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.blend.select import Selector

CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers >= 5.24, then 5.19-5.23
PROBE = "kvtier_probe"  # the keyword a layer's attention gets the pass's _Scatter by
PROBING = "kvtier_probing"  # the attention function registered with transformers
HEADS_AT_ONCE = 8  # query heads scored together by _Scatter.observe (bounds its memory)
QUERIES_AT_ONCE = 64  # queries per SDPA call in prefix_attention


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
    reading_tokens: int = 0  # token-layers the question selection's first pass ran
    read: list[torch.Tensor] = field(default_factory=list)  # per read layer, [N]


class _Scatter:
    """A layer's stand-in cache (see the module docstring)."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: torch.Tensor,
        measure: bool,
        rows: torch.Tensor | None = None,
    ) -> None:
        self.keys, self.values = keys, values
        self.positions = positions
        self.measure = measure
        self.rows = rows  # indices into positions whose attention ``observe`` reads
        self.inner = "sdpa"  # the transformers attention probing_attention runs
        self.deviation: torch.Tensor | None = None  # [S]: |dK|^2 + |dV|^2 per position
        self.attention: torch.Tensor | None = None  # [S]: what the rows pay each position
        self.paid: torch.Tensor | None = None  # [N]: the same, over every position

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

    def observe(
        self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> None:
        """Called by the attention with its ``query`` (``[1, heads, S, dim]``,
        rotated), the layer's ``keys`` (``[1, kv_heads, N, dim]``), the
        additive ``mask`` it applies (None: causal) and its ``scaling``: keeps
        the attention the ``rows`` pay each running position, averaged over
        heads and rows. A no-op where no rows are read."""
        if self.rows is None:
            return
        rows = self.rows
        queries = query[0].index_select(1, rows).float()  # [heads, R, dim]
        group = queries.shape[0] // keys.shape[1]
        if mask is None:
            seen = torch.arange(keys.shape[2])[None] <= self.positions[rows][:, None]
            bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
        else:
            bias = mask[0, 0].index_select(0, rows).float()
        paid = torch.zeros(keys.shape[2])
        for first in range(0, queries.shape[0], HEADS_AT_ONCE):
            q = queries[first : first + HEADS_AT_ONCE]
            heads = torch.arange(first, first + q.shape[0]) // group
            k = keys[0].index_select(0, heads).float()  # [h, N, dim]
            scores = torch.baddbmm(
                bias.expand(q.shape[0], -1, -1), q, k.transpose(1, 2), alpha=scaling
            )
            paid += scores.softmax(-1).sum(dim=(0, 1))
        self.paid = paid / (queries.shape[0] * rows.numel())
        self.attention = self.paid.index_select(0, self.positions)


def probing_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers attention function: the model's own (the probe's
    ``inner``; its modeling module's ``eager_attention_forward`` for
    ``eager``; ``prefix_attention`` for ``sdpa`` in a blended pass), then
    the probe's ``observe``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    probe = kwargs.pop(PROBE, None)
    # no probe: another caller of the model while a pass runs; its own attention
    inner_name = probe.inner if probe is not None else _INNER.get(id(module.config), "sdpa")
    from transformers.models.llama.modeling_llama import eager_attention_forward

    # the model's own eager attention (the Llama family's where it has none)
    own = sys.modules[type(module).__module__]
    eager: Callable[..., Any] = getattr(own, "eager_attention_forward", eager_attention_forward)
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, eager)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out: tuple[torch.Tensor, torch.Tensor | None]
    if probe is not None and inner_name == "sdpa" and not kwargs.get("dropout"):
        # transformers' functions return [batch, S, heads, dim]
        attended = prefix_attention(query, key, value, attention_mask, scaling)
        out = attended.transpose(1, 2).contiguous(), None
    else:
        out = inner(module, query, key, value, attention_mask, **kwargs)
    if probe is not None:
        probe.observe(query, key, attention_mask, scaling)
    return out


_INNER: dict[int, str] = {}  # id(config) -> the implementation probing_attention wraps
# Held while a model's attention is switched: probing passes run one at a time
# (each uses every core anyway), so one never restores what another still needs.
_SWITCH = threading.Lock()


def _attention_of(model: Any) -> str:
    """The attention ``model``'s layers run: the one it declares
    (``attention_implementation``, as ``kvtier.engine.vllm``'s ``BlendModel``
    does), else its transformers config's."""
    declared = getattr(model, "attention_implementation", None)
    return str(declared or getattr(model.config, "_attn_implementation", None) or "eager")


@contextlib.contextmanager
def _probing(model: Any) -> Iterator[str]:
    """A transformers model's attention set to ``probing_attention`` for the
    block; yields the implementation it wraps. Models that call the probe
    themselves (``probes_attention``) are left as they are."""
    config = model.config
    if getattr(model, "probes_attention", False):
        yield _attention_of(model)
        return
    from transformers import AttentionInterface

    AttentionInterface.register(PROBING, probing_attention)
    with _SWITCH:
        inner = _attention_of(model)
        _INNER[id(config)] = inner
        config._attn_implementation = PROBING
        try:
            yield inner
        finally:
            config._attn_implementation = inner
            _INNER.pop(id(config), None)


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


def prefix_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA of ``query`` (``[1, heads, S, dim]``) over ``keys`` and
    ``values`` (``[1, kv_heads, N, dim]``) under an ``attention_mask``
    (None: causal, S == N). Each query there sees a prefix of the keys, so
    queries go ``QUERIES_AT_ONCE`` at a time over the prefix the last of
    them sees, not over all ``N``: the same numbers, with the work the mask
    throws away mostly not done (SDPA's CPU kernel computes every score an
    explicit mask covers)."""
    gqa = query.shape[1] != keys.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
        )
    seen = (mask[0, 0] == 0).sum(dim=-1).tolist()  # keys each query sees
    out = query.new_empty(query.shape[:-1] + values.shape[-1:])
    for first in range(0, query.shape[2], QUERIES_AT_ONCE):
        last = min(first + QUERIES_AT_ONCE, query.shape[2])
        width = max(seen[first:last])
        out[:, :, first:last] = F.scaled_dot_product_attention(
            query[:, :, first:last],
            keys[:, :, :width],
            values[:, :, :width],
            attn_mask=mask[:, :, first:last, :width],
            scale=scale,
            enable_gqa=gqa,
        )
    return out


@torch.inference_mode()
def blend_forward(
    model: Any,
    ids: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    selector: Selector,
    mask: str = "exact",
    rope_positions: torch.Tensor | None = None,
) -> BlendPass:
    """Run ``model`` over the prompt ``ids`` (``[N]``) with every layer's K and
    V preloaded in ``keys``/``values`` (the stored ones at reused positions;
    overwritten in place where a layer runs a position). The last position
    must be one ``selector`` always computes. The ``question`` selection
    first runs the computed positions alone and reads what they attend to
    (they are computed again in the second pass, over the same stored KV).
    ``rope_positions`` (``[N]``, increasing; default ``0 .. N-1``) are the
    positions RoPE gives each index: a segment computed after its anchor at
    an offset leaves a gap there. The mask stays causal over indices."""
    where = torch.arange(ids.numel()) if rope_positions is None else rope_positions
    with _probing(model) as inner:
        run = partial(_blend_layers, model, ids, keys, values, mask=mask, inner=inner, where=where)
        if not selector.reads_question:
            return run(selector)
        reading = run(selector.reader())
        selector.read(reading.read)
        out = run(selector)
        out.reading_tokens = sum(reading.layer_tokens)
        return out


def _blend_layers(
    model: Any,
    ids: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    selector: Selector,
    *,
    mask: str,
    inner: str,
    where: torch.Tensor,
) -> BlendPass:
    decoder = model.model
    layers = decoder.layers
    keyword = cache_keyword(layers[0].forward, type(layers[0]).__name__)
    total = int(ids.numel())
    positions = selector.initial()
    if positions.numel() == 0 or int(positions[-1]) != total - 1:
        raise ValueError("the blend must compute the last prompt token (it gives the logits)")
    hidden = decoder.embed_tokens(ids[positions][None])
    at = where[positions][None]  # the running positions' RoPE positions
    rope = decoder.rotary_emb(hidden, at)
    causal = inner == "sdpa"
    mask_tensor = attention_mask(positions, total, mask, hidden.dtype, causal)
    probed = selector.wants_attention
    layer_tokens, read = [], []
    for n, layer in enumerate(layers):
        narrows, reads = selector.narrows_after(n), selector.reads_after(n)
        looks = probed and (narrows or reads)
        rows = torch.nonzero(selector.computed[positions]).flatten() if looks else None
        scatter = _Scatter(keys, values, positions, measure=narrows, rows=rows)
        scatter.inner = inner
        out = layer(
            hidden,
            attention_mask=mask_tensor,
            position_ids=at,
            position_embeddings=rope,
            use_cache=True,
            **{keyword: scatter, PROBE: scatter},
        )
        hidden = out[0] if isinstance(out, tuple) else out
        layer_tokens.append(int(positions.numel()))
        if reads:
            if scatter.paid is None:
                raise RuntimeError(
                    f"layer {n} ({type(layer).__name__}) did not hand the blend its queries "
                    "through kvtier_probe"
                )
            read.append(scatter.paid)
        if narrows:
            if scatter.deviation is None or (probed and scatter.attention is None):
                raise RuntimeError(
                    f"layer {n} ({type(layer).__name__}) did not hand the blend its K/V "
                    "through the cache, or its queries through kvtier_probe"
                )
            keep = selector.after(n, positions, scatter.deviation, scatter.attention)
            if keep.numel() != positions.numel():
                positions, hidden, at = positions[keep], hidden[:, keep], at[:, keep]
                rope = tuple(t[:, keep] for t in rope)
                mask_tensor = attention_mask(positions, total, mask, hidden.dtype, causal)
    last = decoder.norm(hidden[:, -1:])
    logits: torch.Tensor = model.lm_head(last)[0, -1].float()
    return BlendPass(logits, keys, values, layer_tokens, read=read)


__all__ = [
    "CACHE_ARGUMENTS",
    "PROBE",
    "BlendPass",
    "attention_mask",
    "blend_forward",
    "cache_keyword",
    "prefix_attention",
    "probing_attention",
]
