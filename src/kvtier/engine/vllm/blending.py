"""The blend on vLLM (``kvtier.blend`` = true): a request's documents reused
wherever they appear, on the engine's own model, before its forward.

A request asks for it in ``kv_transfer_params``::

    {"kvtier_blend": {"segments": [[0, 40], [40, 412], [412, 830]],
                      "ratio": 0.15, "selection": "deviation"}}

``segments`` are token spans as for ``KVTierModel.prefill``; the other keys
are ``BlendConfig``'s. The scheduler side offers every prompt token but the
last as a synchronous hit (``blend_request``); before the step's forward,
the worker side (``Blender``) fetches each segment's pieces from kvtier (or
computes the segment alone and stores it), moves its K, runs the blended
pass over the whole prompt on vLLM's model (``BlendModel``, reached through
``kvtier.engine.vllm.capture``): the question is computed there, at every
layer, as in the transformers blend, so the selections that read what the
question attends to (``question``, ``impact``) see the same question. It
writes the K and V of every token but the last into the request's blocks;
vLLM's own forward computes the last token over them. A blend that fails is
a load error: vLLM recomputes those blocks.

Blended KV is approximate and must never be served as exact: a blend
request stores no prefix chunks and offers no hand-off, and the connector
refuses ``kvtier.blend`` while vLLM's prefix cache is on (its block hashes
would claim the blended blocks hold the plain prompt's KV). Segment pieces
are canonical (token order, ``[layers][K, V][kv heads][tokens][head dim]``)
under the segment key domain, like the transformers integration's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.identity import ModelIdentity
from kvtier.engine.link import ServerLink
from kvtier.engine.segments import Blended, SegmentStore, Span, blend_prefill, check_segments
from kvtier.engine.tensors import cache_layers
from kvtier.engine.vllm.blend_model import BlendModel
from kvtier.engine.vllm.capture import ENABLE, captured_model
from kvtier.engine.vllm.metadata import BlendSpec
from kvtier.engine.vllm.pages import write_tokens
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.keys import SegmentHasher
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)
PARAM = "kvtier_blend"
CONFIG_KEYS = frozenset(f.name for f in dataclasses.fields(BlendConfig))


def blend_request(
    params: Mapping[str, Any] | None, prompt_tokens: int
) -> tuple[list[Span], BlendConfig] | None:
    """The spans and config a request's ``kv_transfer_params`` ask for (None:
    no blend); ValueError naming what is wrong."""
    ask = (params or {}).get(PARAM)
    if ask is None:
        return None
    if not isinstance(ask, Mapping) or "segments" not in ask:
        raise ValueError(f'{PARAM} must be an object with "segments": [[start, end], ...]')
    unknown = set(ask) - CONFIG_KEYS - {"segments"}
    if unknown:
        raise ValueError(
            f"{PARAM} has unknown keys {sorted(unknown)}; known: {sorted(CONFIG_KEYS)}"
        )
    spans = check_segments(ask["segments"], prompt_tokens)
    if not spans:
        raise ValueError(f"{PARAM}.segments is empty")
    if spans[-1][1] >= prompt_tokens:
        raise ValueError(
            f"{PARAM}.segments end at {spans[-1][1]}, the prompt's end; leave the question "
            "(at least its last token) outside every segment"
        )
    try:
        config = BlendConfig(**{k: v for k, v in ask.items() if k != "segments"})
    except TypeError as e:
        raise ValueError(f"{PARAM}: {e}") from None
    return spans, config


class Blender:
    """The worker's blends (TP 1): one segment store per tenant salt."""

    def __init__(
        self, vllm_config: Any, settings: ConnectorSettings, identity: ModelIdentity
    ) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.identity = identity
        self._model: BlendModel | None = None
        self._shift: RopeShift | None = None
        self._links: dict[str, ServerLink] = {}
        self._stores: dict[tuple[str, int], SegmentStore] = {}
        self.stats = {"blends": 0, "failed_blends": 0, "reused_tokens": 0, "recomputed_tokens": 0}

    def blend(self, spec: BlendSpec, layers: Sequence[torch.Tensor], block_size: int) -> Blended:
        """Blend ``spec`` into its blocks of ``layers`` (vLLM's paged KV, one
        tensor per layer in order); raises for a blend that could not run.
        The blend (its segments' tokens by tier, its load time) is returned
        for the savings ledger."""
        model, shift = self._prepared()
        store = self._store(spec.salt)
        blended = blend_prefill(model, spec.tokens, spec.spans, spec.config, store, shift)
        blended_layers = cache_layers(blended.cache, store.layout)
        n = spec.written
        for pages, (keys, values) in zip(layers, blended_layers, strict=True):
            write_tokens(pages, spec.block_ids, keys[0, :, :n], values[0, :, :n], block_size)
        self.stats["blends"] += 1
        self.stats["reused_tokens"] += blended.stats.reused_tokens
        self.stats["recomputed_tokens"] += blended.stats.recomputed_tokens
        return blended

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    def _prepared(self) -> tuple[BlendModel, RopeShift]:
        if self._model is None or self._shift is None:
            model = captured_model()
            if model is None:
                raise RuntimeError(
                    f"kvtier.blend needs the model: start the engine with {ENABLE}=1 "
                    "(kvtier's vllm.general_plugins entry point then captures it)"
                )
            self._model = BlendModel.of(model, self.vllm_config.model_config.hf_config)
            self._shift = RopeShift.of(self._model)
        return self._model, self._shift

    def _store(self, salt: str) -> SegmentStore:
        """The segment store of ``salt`` at the server's chunk size (no link
        while the server is away: segments are computed, nothing stored)."""
        model, _ = self._prepared()
        identity = dataclasses.replace(self.identity, salt=salt)
        if salt not in self._links:
            self._links[salt] = ServerLink(
                self.settings.address,
                identity,
                self._layout(model, 1),
                auth_token=self.settings.auth_token,
                lookup_timeout_s=self.settings.request_timeout_s,
                client_id="vllm-blend",
            )
        link = self._links[salt]
        size = link.chunk_size
        key = (salt, size or 0)
        if key not in self._stores:
            layout = self._layout(model, size or 256)
            hasher = SegmentHasher(identity.namespace(layout), layout.tokens_per_chunk)
            self._stores[key] = SegmentStore(link, layout, hasher, model.dtype)
        store = self._stores[key]
        store.link = link if size is not None else None
        return store

    def _layout(self, model: BlendModel, chunk_size: int) -> KVLayout:
        attn = model.vllm_model.model.layers[0].self_attn
        return KVLayout(
            num_layers=len(model.model.layers),
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=str(model.dtype).removeprefix("torch."),
            tokens_per_chunk=chunk_size,
        )


__all__ = ["PARAM", "Blender", "blend_request"]
