"""Segments on the transformers side: reuse a document's KV wherever it is
placed in a prompt (CacheBlend, ``kvtier.blend``).

A prompt comes with ``segments``, the ``(start, end)`` token spans of its
reusable parts (a system prompt, RAG documents); tokens outside them (the
question, glue) are always computed. ``SegmentStore.fetch`` gets one
segment's KV as computed *on its own* (positions ``0 .. n-1``), or, with
``BlendConfig.anchor`` (the default), each moved segment's KV as computed
after the prompt's first segment when that one starts the prompt (the system
prompt), at the largest power of two ``g`` tokens past its end that is no
more than the segment's own offset past it (``BlendConfig.at_offset``:
positions ``A+g .. A+g+n-1``, ``segment_kv``): from kvtier
(every piece found: ``kvtier.keys.segments``, keyed by the anchor and gap too),
else computed now and stored for next time. A segment placed where it was
computed (the system prompt at 0; with the anchor, the document right after
it) is exact as stored; ``blend_prefill`` moves every other segment's K to
its place (``RopeShift``), runs the blended forward
pass (``blend_forward``, the ``Selector`` deciding what to recompute) and
returns an ordinary ``Prefill`` whose cache generation continues from.

Why an anchor: a segment computed alone starts a sequence, so its first
token becomes an attention sink (and the first few frequent tokens lesser
ones) that, moved into a prompt, draw the attention the prompt's own first
token should get; it also never saw the chat template the system prompt
opens. Computed after the system prompt it has neither problem, at the cost
of being found only after that same system prompt.

Blended KV is approximate: it is never stored under prefix-chunk keys (it
would be served as exact KV), only the segments computed alone are stored,
under segment keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from kvtier.blend import BlendConfig, RopeShift, Selector, blend_forward
from kvtier.engine.link import CacheLink, new_request_id
from kvtier.engine.tensors import dynamic_cache, object_tensor, read_chunks
from kvtier.keys import SegmentHasher
from kvtier.layout import KVLayout

Span = tuple[int, int]
ANCHORS_KEPT = 16  # anchors whose segment hashers (one per gap) a store keeps


def check_segments(segments: Sequence[Span], prompt_tokens: int) -> list[Span]:
    """``segments`` as sorted ``(start, end)`` spans of a ``prompt_tokens``-token
    prompt; ValueError naming the bad one when a span is empty, out of
    range, unsorted or overlapping."""
    spans: list[Span] = []
    for i, span in enumerate(segments):
        try:
            start, end = (int(x) for x in span)
        except (TypeError, ValueError):
            message = f"segments[{i}] is {span!r}; give (start, end) token offsets"
            raise ValueError(message) from None
        if not 0 <= start < end <= prompt_tokens:
            raise ValueError(
                f"segments[{i}] is ({start}, {end}); a segment must satisfy "
                f"0 <= start < end <= {prompt_tokens} (the prompt's length)"
            )
        if spans and start < spans[-1][1]:
            raise ValueError(
                f"segments[{i}] ({start}, {end}) starts before segments[{i - 1}] ends "
                f"({spans[-1][1]}); give segments in order, without overlaps"
            )
        spans.append((start, end))
    return spans


@dataclass(slots=True)
class BlendStats:
    """What one blended prefill reused and recomputed."""

    config: BlendConfig
    segments: int
    segments_found: int  # loaded from kvtier; the others were computed alone now
    reused_tokens: int  # prompt tokens whose stored segment KV went in
    # of those, in a segment where it was computed (at position 0, or right after the
    # anchor it was computed after): exact as stored
    exact_tokens: int
    candidate_tokens: int  # the others: a share is recomputed
    recomputed_tokens: int  # candidates the last layer ran
    layer_tokens: list[int] = field(default_factory=list)  # positions each layer ran
    # token-layers run (a question selection's first pass included) / (layers x prompt
    # tokens); full prefill: 1.0
    work: float = 0.0
    computed_alone_tokens: int = 0  # tokens of segments computed alone by this call


@dataclass(slots=True)
class Fetched:
    kv: torch.Tensor  # [layers, 2, 1, kv_heads, tokens, head_dim]
    tiers: dict[str, int]  # pieces found per tier (empty: computed now)
    stored_pieces: int = 0


class SegmentStore:
    """One model's segments through a ``CacheLink`` (None: compute them every time)."""

    def __init__(
        self, link: CacheLink | None, layout: KVLayout, hasher: SegmentHasher, dtype: torch.dtype
    ) -> None:
        self.link = link
        self.layout = layout
        self.hasher = hasher
        self.dtype = dtype
        self._anchored: dict[tuple[int, ...], dict[int, SegmentHasher]] = {}  # by gap

    def fetch(
        self,
        tokens: Sequence[int],
        compute: Callable[[], torch.Tensor],
        timings: SegmentTimings,
        anchor: Sequence[int] | None = None,
        gap: int = 0,
    ) -> Fetched:
        """The segment's KV (``[layers, 2, 1, kv_heads, tokens, head_dim]``)
        as computed alone, or after ``anchor`` (``gap`` positions past its
        end): loaded, else ``compute()``d and stored; see the module
        docstring."""
        link = self.link
        if link is None:
            return Fetched(self._computed(compute, timings), {})
        hashes = self._hasher(anchor, gap).piece_hashes(tokens)
        request_id = new_request_id("seg")
        try:
            started = time.perf_counter()
            hit = link.lookup(request_id, hashes)
            timings.lookup_s += time.perf_counter() - started
            if hit.chunks == len(hashes):
                started = time.perf_counter()
                kv = read_chunks(link, request_id, hit.chunks, len(tokens), self.layout, self.dtype)
                timings.load_s += time.perf_counter() - started
                if kv is not None:
                    return Fetched(kv, dict(hit.chunks_by_tier))
            elif hit.chunks:
                link.release(request_id, 0, hit.chunks)
            kv = self._computed(compute, timings)
            started = time.perf_counter()
            first = hit.chunks if hit.chunks < len(hashes) else 0
            stored = link.store(
                request_id, hashes[first:], self.layout.object_bytes(), self._fill(kv, first)
            )
            timings.store_s += time.perf_counter() - started
            return Fetched(kv, {}, stored)
        finally:
            link.end(request_id)

    def _hasher(self, anchor: Sequence[int] | None, gap: int) -> SegmentHasher:
        if anchor is None:
            return self.hasher
        key = tuple(anchor)
        if key not in self._anchored and len(self._anchored) >= ANCHORS_KEPT:
            self._anchored.clear()
        gaps = self._anchored.setdefault(key, {})  # at most one per power of two
        if gap not in gaps:
            gaps[gap] = self.hasher.after(anchor, gap)
        return gaps[gap]

    def _computed(
        self, compute: Callable[[], torch.Tensor], timings: SegmentTimings
    ) -> torch.Tensor:
        started = time.perf_counter()
        kv = compute()
        timings.compute_s += time.perf_counter() - started
        return kv

    def _fill(self, kv: torch.Tensor, first: int) -> Callable[[int, npt.NDArray[np.uint8]], None]:
        """Writes piece ``first + i`` of ``kv`` into an object (zeros past the end)."""
        c = self.layout.tokens_per_chunk
        tokens = kv.shape[4]

        def fill(i: int, view: npt.NDArray[np.uint8]) -> None:
            start = (first + i) * c
            end = min(start + c, tokens)
            piece = object_tensor(view, self.layout, self.dtype)
            piece[:, :, :, : end - start].copy_(kv[:, :, 0, :, start:end])
            if end - start < c:
                piece[:, :, :, end - start :].zero_()

        return fill


@dataclass(slots=True)
class SegmentTimings:
    lookup_s: float = 0.0
    load_s: float = 0.0  # reading found segments (L1 copy) and moving them into place
    compute_s: float = 0.0  # computing missing segments alone
    store_s: float = 0.0
    blend_s: float = 0.0  # the blended forward pass


@dataclass(slots=True)
class Blended:
    logits: torch.Tensor  # [vocab], float32
    cache: DynamicCache
    stats: BlendStats
    tiers: dict[str, int]  # tokens found per tier
    stored_pieces: int
    loaded_pieces: int
    timings: SegmentTimings


def segment_kv(
    model: Any,
    ids: Sequence[int],
    anchor_kv: torch.Tensor | None,
    store: SegmentStore,
    gap: int = 0,
) -> torch.Tensor:
    """The KV of a segment computed on its own, ``[layers, 2, 1, kv_heads,
    n, head_dim]``: ``ids`` is the segment's tokens, or the anchor's and then
    the segment's when ``anchor_kv`` (the anchor's KV, as ``fetch`` gives it)
    is given, and only the segment's positions run, over the anchor's KV,
    ``gap`` positions past its end (RoPE positions ``A+gap ..``)."""
    layout = store.layout
    held = 0 if anchor_kv is None else anchor_kv.shape[4]
    shape = (layout.num_layers, 1, layout.kv_heads, len(ids), layout.head_dim)
    keys = torch.zeros(shape, dtype=store.dtype)
    values = torch.zeros(shape, dtype=store.dtype)
    if anchor_kv is not None:
        keys[:, :, :, :held] = anchor_kv[:, 0]
        values[:, :, :, :held] = anchor_kv[:, 1]
    run = torch.zeros(len(ids), dtype=torch.bool)
    run[held:] = True
    selector = Selector(BlendConfig(ratio=0.0), layout.num_layers, run, torch.zeros_like(run), [])
    where = torch.arange(len(ids))
    where[held:] += gap
    out = blend_forward(
        model, torch.tensor(list(ids)), list(keys), list(values), selector, rope_positions=where
    )
    layers = [
        torch.stack((k[:, :, held:], v[:, :, held:]))
        for k, v in zip(out.keys, out.values, strict=True)
    ]
    return torch.stack(layers)


def blend_prefill(
    model: Any,
    ids: Sequence[int],
    spans: Sequence[Span],
    config: BlendConfig,
    store: SegmentStore,
    shift: RopeShift,
) -> Blended:
    """Blend one prompt whose reusable segments are ``spans`` (checked);
    ``model`` is a transformers causal LM, or what ``blend_forward`` takes
    for one (``kvtier.engine.vllm.blend_model``)."""
    layout = store.layout
    total = len(ids)
    timings = SegmentTimings()
    shape = (layout.num_layers, 1, layout.kv_heads, total, layout.head_dim)
    keys = torch.zeros(shape, dtype=store.dtype)
    values = torch.zeros(shape, dtype=store.dtype)
    computed = torch.ones(total, dtype=torch.bool)
    candidates = torch.zeros(total, dtype=torch.bool)
    moved: list[Span] = []
    tiers: dict[str, int] = {}
    found = stored = loaded = alone = 0
    anchored = config.anchor and len(spans) > 1 and spans[0][0] == 0
    anchor_kv: torch.Tensor | None = None  # the first segment's, once fetched
    for start, end in spans:
        tokens = ids[start:end]
        after = anchor_kv if anchored and start > 0 else None
        anchor = ids[: spans[0][1]] if after is not None else None
        gap = config.gap(start - len(anchor)) if anchor is not None else 0

        compute = partial(segment_kv, model, [*(anchor or ()), *tokens], after, store, gap)
        fetched = store.fetch(tokens, compute, timings, anchor, gap)
        if start == 0:
            anchor_kv = fetched.kv
        origin = len(anchor) + gap if anchor is not None else 0  # where the stored K sits
        started = time.perf_counter()
        keys[:, :, :, start:end] = shift.rotate(fetched.kv[:, 0], start - origin)
        values[:, :, :, start:end] = fetched.kv[:, 1]
        timings.load_s += time.perf_counter() - started
        computed[start:end] = False
        if start != origin or gap:  # its stored KV lacks (some of) the context before it
            candidates[start:end] = True
            moved.append((start, end))
        pieces = sum(fetched.tiers.values())
        if pieces:
            found += 1
            loaded += pieces
            for tier, count in fetched.tiers.items():
                tiers[tier] = tiers.get(tier, 0) + count * layout.tokens_per_chunk
        else:
            alone += end - start
        stored += fetched.stored_pieces
    computed[-1] = True  # the last token gives the logits
    candidates[-1] = False
    selector = Selector(config, layout.num_layers, computed, candidates, moved)
    started = time.perf_counter()
    out = blend_forward(
        model, torch.tensor(list(ids)), list(keys), list(values), selector, config.mask
    )
    timings.blend_s = time.perf_counter() - started
    reused = total - int(computed.sum())
    last = out.layer_tokens[-1]
    stats = BlendStats(
        config=config,
        segments=len(spans),
        segments_found=found,
        reused_tokens=reused,
        exact_tokens=reused - selector.total,
        candidate_tokens=selector.total,
        recomputed_tokens=last - (total - reused),
        layer_tokens=out.layer_tokens,
        work=(sum(out.layer_tokens) + out.reading_tokens) / (layout.num_layers * total),
        computed_alone_tokens=alone,
    )
    cache = dynamic_cache(out.keys, out.values)
    return Blended(out.logits, cache, stats, tiers, stored, loaded, timings)


__all__ = [
    "BlendStats",
    "Blended",
    "SegmentStore",
    "SegmentTimings",
    "Span",
    "blend_prefill",
    "check_segments",
    "segment_kv",
]
