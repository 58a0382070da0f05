"""Hugging Face transformers on kvtier: ``KVTierModel`` wraps a causal LM.

For one prompt, ``prefill`` hashes its full chunks, looks them up (through
the node's cache server, or a ``StorageManager`` in this process), copies the
hit chunks' KV into a ``DynamicCache``, runs the model on the rest of the
prompt only, and stores the prompt's new full chunks. A full hit still runs
the last prompt token, so there are logits. ``generate`` decodes greedily
from there. Anything the cache does wrong is a miss: the prompt is computed.

Given ``segments`` (the token spans of a prompt's reusable parts: a system
prompt, RAG documents), ``prefill`` blends instead (CacheBlend,
``kvtier.engine.segments``): each segment's KV as computed on its own is
loaded from kvtier (or computed alone and stored), moved to its place in the
prompt, and a selected share of its tokens is recomputed (``BlendConfig``).
Blended KV is approximate and is never stored as prefix chunks. With a
``quality_gate``, a sampled share of blends (and of prefills that loaded KV
under a lossy codec) also run full prefill, are answered from it and compared;
when the gate turns a path off, its prompts get exact reuse or recompute
(``kvtier.engine.quality_gate``).

Object bytes (the same for every engine, so engines can share KV): one chunk
of one rank, ``[num_layers][K, V][kv_heads][tokens_per_chunk][head_dim]`` in
the model's dtype, C order. ``kv_layout`` is the one place a model's KV
becomes a ``KVLayout``; its digest, the model's name, revision and dtype and
the tenant salt root the chunk hashes, so any of them changing is a miss.
The salt is hashed as its key label (``ModelIdentity.namespace``), as the
vLLM connector and the router hash it: one salt, one namespace, whichever
engine computed the KV.

Supported: decoder-only models whose layers all hold full (or sliding-window)
attention KV with equal K and V head sizes, at batch size 1 (Llama, Qwen2/3,
Mistral, Gemma...). Sliding-window layers are kept whole (the attention mask
applies the window), so their chunks are complete. Models with recurrent or
linear-attention layers, or MLA caches whose K and V sizes differ, are refused
with a ValueError.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache, PreTrainedModel

from kvtier.blend import BlendConfig, RopeShift
from kvtier.blend.forward import cache_keyword
from kvtier.engine.hf_identity import model_identity
from kvtier.engine.link import CacheLink, LocalLink, ServerLink, new_request_id
from kvtier.engine.quality_gate import GateState, QualityGate, Sample, compare
from kvtier.engine.segments import BlendStats, SegmentStore, Span, blend_prefill, check_segments
from kvtier.engine.shadow import ShadowCheck
from kvtier.engine.tensors import cache_layers, dynamic_cache, object_tensor, read_chunks
from kvtier.keys import SegmentHasher, TokenHasher
from kvtier.layout import KVLayout
from kvtier.protocol.client import Fill
from kvtier.storage import StorageManager

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


def kv_layout(model: PreTrainedModel, chunk_size: int, lossy_codec: str = "") -> KVLayout:
    """The ``KVLayout`` of ``model``'s KV cache (per token: 2 x layers x
    kv_heads x head_dim in the model's dtype); ValueError for a model whose
    cache is not plain attention KV. ``lossy_codec``: see ``KVLayout``."""
    config = model.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS
    if kinds:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(sorted(kinds))} layers; kvtier's transformers "
            "integration supports models whose layers all hold attention KV"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for name in ("v_head_dim", "kv_lora_rank"):  # MLA: K and V differ in size
        if getattr(config, name, None):
            raise ValueError(
                f"{type(model).__name__} uses MLA ({name}); its K and V caches differ in size, "
                "which kvtier's transformers integration does not support"
            )
    return KVLayout(
        num_layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype=str(model.dtype).removeprefix("torch."),
        tokens_per_chunk=chunk_size,
        lossy_codec=lossy_codec,
    )


def cache_argument(model: PreTrainedModel) -> str:
    """The name ``model.forward`` takes its cache by: ``cache`` (transformers
    5.24 and later) or ``past_key_values`` (before)."""
    return cache_keyword(model.forward, type(model).__name__)


@dataclass(slots=True)
class Timings:
    """Seconds spent per step of one prefill; ``ttft_s`` is the whole call."""

    lookup_s: float = 0.0  # hashing and the lookup
    load_s: float = 0.0  # copying hit KV into the cache
    prefill_s: float = 0.0  # running the model on the rest of the prompt
    store_s: float = 0.0  # copying new chunks out
    shadow_s: float = 0.0  # the shadow check, when this prompt was sampled
    ttft_s: float = 0.0


@dataclass(slots=True)
class Prefill:
    """One prompt's prefill: the last token's logits and the KV cache."""

    logits: torch.Tensor  # [vocab], float32
    cache: DynamicCache
    prompt_tokens: int
    hit_tokens: int = 0  # prompt tokens whose KV came from kvtier
    computed_tokens: int = 0  # prompt tokens the model ran on (a full hit: 1)
    stored_tokens: int = 0  # prompt tokens in chunks stored by this call
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # found tokens per tier
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_failed: bool = False  # the hit could not be read; the prompt was computed
    miss_reason: str = ""  # why the hit ends where it does (``Hit.miss_reason``)
    shadow_error: float | None = None  # the shadow check's error, if this prompt was sampled
    blend: BlendStats | None = None  # a blended prefill's (segments given)
    # The quality gate (``kvtier.engine.quality_gate``): "" not asked; "shadowed": a
    # lossy prefill sampled, compared (``quality``) and answered from full prefill;
    # "off": the lossy path is off for this namespace, exact reuse or recompute served.
    gate: str = ""
    quality: Sample | None = None
    timings: Timings = field(default_factory=Timings)


@dataclass(slots=True)
class Generation:
    tokens: list[int]  # generated token ids (greedy)
    logits: torch.Tensor  # [len(tokens), vocab], float32: the logits each token came from
    prefill: Prefill
    decode_s: float


class KVTierModel:
    """A transformers causal LM with kvtier underneath; see the module docstring.

    ``server``: the node's cache server address (``tcp://host:port``); else
    ``storage``: a ``StorageManager`` in this process (``chunk_size`` tokens
    per chunk); neither: no cache (a reference run). ``name``/``revision``/
    ``salt``: see ``model_identity``. ``client_options`` go to ``ClientConfig``.
    ``shadow``: recompute one hit chunk of a sampled fraction of prompts and
    compare it with what was loaded (``kvtier.engine.shadow``).
    ``lossy_codec``: let slower tiers keep this model's KV with that lossy
    codec (``"int8"``, ``"int4"``; ``KVLayout.lossy_codec``): its keys are
    then its own, apart from exact KV's.
    ``quality_gate``: shadow a sampled share of lossy prefills (blends, and
    loads under ``lossy_codec``) with full prefill, and turn the lossy path
    off for this model when quality falls (``kvtier.engine.quality_gate``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        server: str | None = None,
        storage: StorageManager | None = None,
        chunk_size: int = 256,
        name: str | None = None,
        revision: str | None = None,
        salt: str = "",
        auth_token: str = "",
        lookup_timeout_s: float = 5.0,
        client_options: dict[str, Any] | None = None,
        shadow: ShadowCheck | None = None,
        lossy_codec: str = "",
        quality_gate: QualityGate | None = None,
    ) -> None:
        if server is not None and storage is not None:
            raise ValueError("pass server= or storage=, not both")
        self.model = model.eval()
        self.shadow = shadow
        self.quality_gate = quality_gate
        self.identity = model_identity(model, name, revision, salt)
        self._cache_argument = cache_argument(model)
        self._vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        self._hashers: dict[int, tuple[KVLayout, TokenHasher]] = {}
        self._chunk_size = chunk_size
        self._lossy_codec = lossy_codec
        self._shift: RopeShift | None = None
        self._segment_store: SegmentStore | None = None
        self.link: CacheLink | None = None
        if server is not None:
            self.link = ServerLink(
                server,
                self.identity,
                kv_layout(model, 1, lossy_codec),  # the server chooses the chunk size
                auth_token=auth_token,
                lookup_timeout_s=lookup_timeout_s,
                **(client_options or {}),
            )
        elif storage is not None:
            layout = kv_layout(model, chunk_size, lossy_codec)
            self.link = LocalLink(storage, self.identity, layout)
        else:
            kv_layout(model, chunk_size, lossy_codec)  # refuse unsupported models up front

    # ------------------------------------------------------------ requests

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        *,
        segments: Sequence[Span] | None = None,
        blend: BlendConfig | None = None,
    ) -> Prefill:
        """Prefill one prompt through kvtier; see the module docstring.
        ``segments``: blend, recomputing what ``blend`` selects (default
        ``BlendConfig()``); ValueError for bad spans or a model whose K
        cannot move (``RopeShift.of``)."""
        ids = self._token_ids(input_ids)
        if segments is not None:
            spans = check_segments(segments, len(ids))
            if self._lossy_allowed("blend"):
                return self._gated("blend", ids, self._blend(ids, spans, blend or BlendConfig()))
            return self._gated_off(self._prefix(ids))
        return self._prefix(ids)

    def _prefix(self, ids: list[int]) -> Prefill:
        """Prefix reuse; under a lossy codec a hit is lossy KV, gated as a blend is."""
        if not self._lossy_codec:
            return self._exact(ids)
        path = f"codec:{self._lossy_codec}"
        if not self._lossy_allowed(path):
            return self._gated_off(self._full(ids))
        prefill = self._exact(ids)
        return self._gated(path, ids, prefill) if prefill.hit_tokens else prefill

    def _exact(self, ids: list[int]) -> Prefill:
        """Prefix reuse of exact chunks (lossy ones under ``lossy_codec``)."""
        started = time.perf_counter()
        timings = Timings()
        chunk_size = self.link.chunk_size if self.link is not None else None
        if self.link is None or chunk_size is None:
            return self._full(ids)
        layout, hasher = self._hasher(chunk_size)
        hashes = hasher.chunk_hashes(ids)
        request_id = new_request_id("hf")
        try:
            return self._prefill(ids, request_id, hashes, layout, self.link, started, timings)
        finally:
            if hashes:  # a prompt shorter than a chunk never opened a session
                self.link.end(request_id)

    def _full(self, ids: list[int]) -> Prefill:
        """Full prefill, no cache: what the engine computes without kvtier."""
        started = time.perf_counter()
        cache = DynamicCache()
        result = Prefill(self._forward(ids, cache), cache, len(ids), computed_tokens=len(ids))
        result.timings.prefill_s = result.timings.ttft_s = time.perf_counter() - started
        return result

    def _gate_namespace(self, path: str) -> str:
        return f"{self.identity.model}/{path}"

    def _lossy_allowed(self, path: str) -> bool:
        gate = self.quality_gate
        return gate is None or gate.allows(self._gate_namespace(path))

    def _gated(self, path: str, ids: list[int], lossy: Prefill) -> Prefill:
        """``lossy``, unless the gate samples it: then full prefill too, the
        comparison counted (and reported), and full prefill's answer."""
        gate = self.quality_gate
        if gate is None or not gate.sample():
            return lossy
        started = time.perf_counter()
        full = self._full(ids)
        sample = compare(lossy.logits, full.logits)
        verdict = gate.observe(self._gate_namespace(path), sample)
        if self.link is not None:
            self.link.report_quality(path, sample.agreed, sample.kl, verdict.state is GateState.OFF)
        full.gate, full.quality, full.blend = "shadowed", sample, lossy.blend
        full.timings.shadow_s = time.perf_counter() - started
        full.timings.ttft_s = lossy.timings.ttft_s + full.timings.shadow_s
        return full

    @staticmethod
    def _gated_off(prefill: Prefill) -> Prefill:
        prefill.gate = "off"
        return prefill

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 16,
        eos_token_id: int | None = None,
        *,
        segments: Sequence[Span] | None = None,
        blend: BlendConfig | None = None,
    ) -> Generation:
        """Greedy decoding after ``prefill``; stops at ``eos_token_id``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prefill = self.prefill(input_ids, segments=segments, blend=blend)
        return self.decode(prefill, max_new_tokens, eos_token_id)

    @torch.inference_mode()
    def decode(
        self, prefill: Prefill, max_new_tokens: int = 16, eos_token_id: int | None = None
    ) -> Generation:
        """Greedy decoding from a prefill (its cache grows); stops at ``eos_token_id``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.perf_counter()
        logits = [prefill.logits]
        tokens = [int(prefill.logits.argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            logits.append(self._forward(tokens[-1:], prefill.cache))
            tokens.append(int(logits[-1].argmax()))
        return Generation(tokens, torch.stack(logits), prefill, time.perf_counter() - started)

    def pin(self, input_ids: Sequence[int] | torch.Tensor, ttl_s: float = 3600.0) -> int:
        """Keep the prompt's stored full chunks in L1 for ``ttl_s`` seconds
        (a system prompt, say; within the tenant's pin cap; 0 unpins); the
        prompt tokens pinned."""
        chunk_size = self.link.chunk_size if self.link is not None else None
        if self.link is None or chunk_size is None:
            return 0
        _, hasher = self._hasher(chunk_size)
        hashes = hasher.chunk_hashes(self._token_ids(input_ids))
        return self.link.pin(hashes, ttl_s) * chunk_size if hashes else 0

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def __enter__(self) -> KVTierModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- internals

    def _prefill(
        self,
        ids: list[int],
        request_id: str,
        hashes: list[bytes],
        layout: KVLayout,
        link: CacheLink,
        started: float,
        timings: Timings,
    ) -> Prefill:
        chunk_size = layout.tokens_per_chunk
        hit = link.lookup(request_id, hashes) if hashes else None
        hit_chunks = hit.chunks if hit is not None else 0
        now = time.perf_counter()
        timings.lookup_s, mark = now - started, now

        use = min(hit_chunks * chunk_size, len(ids) - 1)  # a full hit recomputes the last token
        kv = (
            read_chunks(link, request_id, hit_chunks, use, layout, self.model.dtype)
            if use
            else None
        )
        loaded = kv is not None or not use
        if kv is None:
            use = 0
            cache = DynamicCache()
        else:
            cache = dynamic_cache(list(kv[:, 0]), list(kv[:, 1]))
        now = time.perf_counter()
        timings.load_s, mark = now - mark, now

        logits = self._forward(ids[use:], cache)
        now = time.perf_counter()
        timings.prefill_s, mark = now - mark, now

        new = hashes[hit_chunks:]
        stored = (
            link.store(
                request_id, new, layout.object_bytes(), self._gather(cache, hit_chunks, layout)
            )
            if new
            else 0
        )
        now = time.perf_counter()
        timings.store_s, mark = now - mark, now

        last = use // chunk_size - 1  # the last loaded chunk
        sampled = self.shadow is not None and loaded and last >= 0 and self.shadow.sample()
        error = self._shadow(link, ids, cache, last, layout) if sampled else None
        now = time.perf_counter()
        timings.shadow_s, timings.ttft_s = now - mark, now - started
        link.report_usage(timings.prefill_s, len(ids) - use, timings.load_s if use else 0.0, use)
        tiers = hit.chunks_by_tier if hit is not None and loaded else {}
        return Prefill(
            logits,
            cache,
            len(ids),
            hit_tokens=use,
            computed_tokens=len(ids) - use,
            stored_tokens=stored * chunk_size,
            tokens_by_tier={tier: chunks * chunk_size for tier, chunks in tiers.items()},
            bytes_loaded=math.ceil(use / chunk_size) * layout.object_bytes(),
            bytes_stored=stored * layout.object_bytes(),
            load_failed=not loaded,
            miss_reason=("load_failed" if not loaded else hit.miss_reason) if hit else "",
            shadow_error=error,
            timings=timings,
        )

    def _shadow(
        self, link: CacheLink, ids: list[int], cache: DynamicCache, chunk: int, layout: KVLayout
    ) -> float:
        """Recompute loaded chunk ``chunk`` on top of the loaded chunks before
        it and compare (``ShadowCheck.compare``)."""
        assert self.shadow is not None
        start, end = chunk * layout.tokens_per_chunk, (chunk + 1) * layout.tokens_per_chunk
        context = DynamicCache()
        for n, (keys, values) in enumerate(cache_layers(cache, layout)):
            context.update(keys[:, :, :start], values[:, :, :start], n)
        self._forward(ids[start:end], context)
        served, computed = (
            torch.stack([t[0, :, start:end] for pair in cache_layers(c, layout) for t in pair])
            for c in (cache, context)
        )  # [layers x (K, V), kv_heads, tokens, head_dim]
        what = f"chunk {chunk} of a {len(ids)}-token prompt"
        verdict = self.shadow.compare(served, computed, what)
        link.report_shadow(1, int(verdict.mismatched))
        return verdict.error

    def _gather(self, cache: DynamicCache, first: int, layout: KVLayout) -> Fill:
        """A ``Fill`` writing chunk ``first + i`` of ``cache`` into an object."""
        c = layout.tokens_per_chunk
        dtype = self.model.dtype
        layers = cache_layers(cache, layout)

        def fill(i: int, view: npt.NDArray[np.uint8]) -> None:
            start = (first + i) * c
            chunk = object_tensor(view, layout, dtype)
            for n, (keys, values) in enumerate(layers):
                chunk[n, 0].copy_(keys[0, :, start : start + c])
                chunk[n, 1].copy_(values[0, :, start : start + c])

        return fill

    def _forward(self, ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Run ``ids`` on top of ``cache``; the last position's logits, float32."""
        out = self.model(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def _blend(self, ids: list[int], spans: list[Span], config: BlendConfig) -> Prefill:
        started = time.perf_counter()
        if self._shift is None:
            self._shift = RopeShift.of(self.model)
        segments = self._segments()
        blended = blend_prefill(self.model, ids, spans, config, segments, self._shift)
        t, stats = blended.timings, blended.stats
        loaded = sum(blended.tiers.values())
        if segments.link is not None:  # an upper bound: a blend recomputes a share of it
            segments.link.report_usage(0.0, 0, t.load_s, loaded)  # its forward is no prefill
        object_bytes = segments.layout.object_bytes()
        return Prefill(
            blended.logits,
            blended.cache,
            len(ids),
            hit_tokens=loaded,
            computed_tokens=stats.layer_tokens[-1],
            stored_tokens=stats.computed_alone_tokens if blended.stored_pieces else 0,
            tokens_by_tier=blended.tiers,
            bytes_loaded=blended.loaded_pieces * object_bytes,
            bytes_stored=blended.stored_pieces * object_bytes,
            blend=stats,
            timings=Timings(
                lookup_s=t.lookup_s,
                load_s=t.load_s,
                prefill_s=t.compute_s + t.blend_s,
                store_s=t.store_s,
                ttft_s=time.perf_counter() - started,
            ),
        )

    def _segments(self) -> SegmentStore:
        """Where segments live: the link's, at its chunk size (none while the
        cache is away: every segment is computed, nothing stored)."""
        chunk_size = self.link.chunk_size if self.link is not None else None
        link = self.link if chunk_size is not None else None
        size = chunk_size or self._chunk_size
        if self._segment_store is None or self._segment_store.hasher.chunk_size != size:
            layout = kv_layout(self.model, size, self._lossy_codec)
            hasher = SegmentHasher(self.identity.namespace(layout), size)
            self._segment_store = SegmentStore(link, layout, hasher, self.model.dtype)
        self._segment_store.link = link
        return self._segment_store

    def _hasher(self, chunk_size: int) -> tuple[KVLayout, TokenHasher]:
        if chunk_size not in self._hashers:
            layout = kv_layout(self.model, chunk_size, self._lossy_codec)
            namespace = self.identity.namespace(layout)
            self._hashers[chunk_size] = (layout, TokenHasher(namespace, chunk_size))
        return self._hashers[chunk_size]

    def _token_ids(self, input_ids: Sequence[int] | torch.Tensor) -> list[int]:
        """One prompt's ids as ints: ``[tokens]`` or ``[1, tokens]`` of integers
        (a list, a numpy array or a tensor), each in the vocabulary."""
        try:
            ids = (
                input_ids.detach().cpu().numpy()
                if isinstance(input_ids, torch.Tensor)
                else np.asarray(input_ids)
            )
        except ValueError:  # a ragged nested list
            raise ValueError("input_ids is ragged; pass one prompt as a list of ints") from None
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1:
            raise ValueError(
                f"input_ids has shape {ids.shape}; pass one prompt ([tokens] or [1, tokens])"
            )
        if ids.size == 0:
            raise ValueError("the prompt is empty; pass at least one token id")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers; input_ids holds {ids.dtype} values")
        bad = ids[(ids < 0) | (ids >= self._vocab)]
        if bad.size:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self._vocab})")
        return [int(t) for t in ids.tolist()]
