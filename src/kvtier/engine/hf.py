"""Hugging Face transformers on kvtier: ``KVTierModel`` wraps a causal LM.

For one prompt, ``prefill`` hashes its full chunks, looks them up (through
the node's cache server, or a ``StorageManager`` in this process), copies the
hit chunks' KV into a ``DynamicCache``, runs the model on the rest of the
prompt only, and stores the prompt's new full chunks. A full hit still runs
the last prompt token, so there are logits. ``generate`` decodes greedily
from there. Anything the cache does wrong is a miss: the prompt is computed.

Object bytes (the same for every engine, so engines can share KV): one chunk
of one rank, ``[num_layers][K, V][kv_heads][tokens_per_chunk][head_dim]`` in
the model's dtype, C order. ``kv_layout`` is the one place a model's KV
becomes a ``KVLayout``; its digest, the model's name, revision and dtype and
the tenant salt root the chunk hashes, so any of them changing is a miss.

Supported: decoder-only models whose layers all hold full (or sliding-window)
attention KV with equal K and V head sizes, at batch size 1 (Llama, Qwen2/3,
Mistral, Gemma...). Sliding-window layers are kept whole (the attention mask
applies the window), so their chunks are complete. Models with recurrent or
linear-attention layers, or MLA caches whose K and V sizes differ, are refused
with a ValueError.
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvtier.engine.identity import (
    ModelIdentity,
    checkpoint_names,
    fingerprint,
    hub_commit,
    state_tensors,
)
from kvtier.engine.identity import model_identity as identity_of
from kvtier.engine.link import CacheLink, LocalLink, ServerLink, new_request_id
from kvtier.engine.shadow import ShadowCheck
from kvtier.keys import TokenHasher
from kvtier.layout import KVLayout
from kvtier.server.client import Fill
from kvtier.storage import StorageManager

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers >= 5.24, then 5.19-5.23


def kv_layout(model: PreTrainedModel, chunk_size: int) -> KVLayout:
    """The ``KVLayout`` of ``model``'s KV cache (per token: 2 x layers x
    kv_heads x head_dim in the model's dtype); ValueError for a model whose
    cache is not plain attention KV."""
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
    )


def cache_argument(model: PreTrainedModel) -> str:
    """The name ``model.forward`` takes its cache by: ``cache`` (transformers
    5.24 and later) or ``past_key_values`` (before)."""
    parameters = inspect.signature(model.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(
        f"{type(model).__name__}.forward takes neither of {CACHE_ARGUMENTS}; install a "
        "transformers release in the range kvtier's pyproject.toml pins"
    )


def weights_fingerprint(model: PreTrainedModel) -> str:
    """A loaded model's weights fingerprint (``identity.fingerprint``): the
    revision of weights that have none. Pass a real revision (a commit hash,
    a checksum) to ``KVTierModel`` to be exact."""
    return fingerprint(state_tensors(model.state_dict()))


def model_identity(
    model: PreTrainedModel, name: str | None = None, revision: str | None = None, salt: str = ""
) -> ModelIdentity:
    """``identity.model_identity`` for a transformers model: its name is
    ``name``, else its ``name_or_path``, else its type. The revision comes
    from what was loaded, never from ``name`` (a display name must not borrow
    the hub cache's commit of another model): the hub commit, else the
    weights' fingerprint, taken from memory (weights changed after loading
    fingerprint differently) over the tensors of the safetensors files it was
    loaded from, when there are some (so it equals the vLLM connector's,
    which reads the files)."""
    config = model.config
    source = getattr(config, "name_or_path", "") or ""
    revision = revision or getattr(config, "_commit_hash", None)  # the hub commit
    if revision is None and name and name != source:
        revision = (hub_commit(str(Path(source).resolve())) if source else None) or _weights(
            model, source
        )
    return identity_of(
        name or source or config.model_type,
        config.to_dict(),
        revision=revision,
        weights=lambda: _weights(model, source),
        salt=salt,
    )


def _weights(model: PreTrainedModel, source: str) -> str:
    state = model.state_dict()
    files = sorted(Path(source).glob("*.safetensors")) if source and Path(source).is_dir() else []
    names = checkpoint_names(files)
    if names and names <= state.keys():
        return fingerprint(state_tensors({k: v for k, v in state.items() if k in names}))
    return weights_fingerprint(model)


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
    ) -> None:
        if server is not None and storage is not None:
            raise ValueError("pass server= or storage=, not both")
        self.model = model.eval()
        self.shadow = shadow
        self.identity = model_identity(model, name, revision, salt)
        self._cache_argument = cache_argument(model)
        self._vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        self._hashers: dict[int, tuple[KVLayout, TokenHasher]] = {}
        self.link: CacheLink | None = None
        if server is not None:
            self.link = ServerLink(
                server,
                self.identity,
                kv_layout(model, 1),  # the server chooses the chunk size
                auth_token=auth_token,
                lookup_timeout_s=lookup_timeout_s,
                **(client_options or {}),
            )
        elif storage is not None:
            self.link = LocalLink(storage, self.identity, kv_layout(model, chunk_size))
        else:
            kv_layout(model, chunk_size)  # refuse unsupported models up front

    # ------------------------------------------------------------ requests

    @torch.inference_mode()
    def prefill(self, input_ids: Sequence[int] | torch.Tensor) -> Prefill:
        """Prefill one prompt through kvtier; see the module docstring."""
        ids = self._token_ids(input_ids)
        started = time.perf_counter()
        timings = Timings()
        chunk_size = self.link.chunk_size if self.link is not None else None
        if self.link is None or chunk_size is None:
            cache = DynamicCache()
            result = Prefill(self._forward(ids, cache), cache, len(ids), computed_tokens=len(ids))
            timings.prefill_s = timings.ttft_s = time.perf_counter() - started
            result.timings = timings
            return result
        layout, hasher = self._hasher(chunk_size)
        hashes = hasher.chunk_hashes(ids)
        request_id = new_request_id("hf")
        try:
            return self._prefill(ids, request_id, hashes, layout, self.link, started, timings)
        finally:
            if hashes:  # a prompt shorter than a chunk never opened a session
                self.link.end(request_id)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 16,
        eos_token_id: int | None = None,
    ) -> Generation:
        """Greedy decoding after ``prefill``; stops at ``eos_token_id``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prefill = self.prefill(input_ids)
        started = time.perf_counter()
        logits = [prefill.logits]
        tokens = [int(prefill.logits.argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            logits.append(self._forward(tokens[-1:], prefill.cache))
            tokens.append(int(logits[-1].argmax()))
        return Generation(tokens, torch.stack(logits), prefill, time.perf_counter() - started)

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
        cache = DynamicCache()
        loaded = self._load(link, request_id, hit_chunks, use, layout, cache) if use else True
        if not loaded:
            use = 0
            cache = DynamicCache()
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

    def _load(
        self,
        link: CacheLink,
        request_id: str,
        chunks: int,
        tokens: int,
        layout: KVLayout,
        cache: DynamicCache,
    ) -> bool:
        """Copy the first ``tokens`` tokens of hit chunks [0, chunks) into ``cache``."""
        c = layout.tokens_per_chunk
        dtype = self.model.dtype
        kv = torch.empty(
            (layout.num_layers, 2, 1, layout.kv_heads, tokens, layout.head_dim), dtype=dtype
        )

        def consume(i: int, view: npt.NDArray[np.uint8]) -> None:
            end = min(tokens, (i + 1) * c)
            chunk = _as_chunk(view, layout, dtype)
            kv[:, :, 0, :, i * c : end].copy_(chunk[:, :, :, : end - i * c])

        try:
            if not link.load(request_id, 0, chunks, consume):
                return False
        except ValueError:  # an object of the wrong size: a miss, never wrong KV
            return False
        for n in range(layout.num_layers):
            keys, values = kv[n, 0], kv[n, 1]
            cache.update(keys[:, :, :0], values[:, :, :0], n)  # creates the layer, copies nothing
            layer = cache.layers[n]
            if isinstance(layer, DynamicLayer):  # adopt the loaded tensors: no second copy
                layer.keys, layer.values = keys, values
            else:
                cache.update(keys, values, n)
        return True

    def _shadow(
        self, link: CacheLink, ids: list[int], cache: DynamicCache, chunk: int, layout: KVLayout
    ) -> float:
        """Recompute loaded chunk ``chunk`` on top of the loaded chunks before
        it and compare (``ShadowCheck.compare``)."""
        assert self.shadow is not None
        start, end = chunk * layout.tokens_per_chunk, (chunk + 1) * layout.tokens_per_chunk
        context = DynamicCache()
        for n, (keys, values) in enumerate(_layers(cache, layout)):
            context.update(keys[:, :, :start], values[:, :, :start], n)
        self._forward(ids[start:end], context)
        served, computed = (
            torch.stack([t[0, :, start:end] for pair in _layers(c, layout) for t in pair])
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
        layers = _layers(cache, layout)

        def fill(i: int, view: npt.NDArray[np.uint8]) -> None:
            start = (first + i) * c
            chunk = _as_chunk(view, layout, dtype)
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

    def _hasher(self, chunk_size: int) -> tuple[KVLayout, TokenHasher]:
        if chunk_size not in self._hashers:
            layout = kv_layout(self.model, chunk_size)
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


def _layers(cache: DynamicCache, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V, ``[1, kv_heads, tokens, head_dim]``; ValueError
    for a cache that does not hold them so."""
    expected = (1, layout.kv_heads, layout.head_dim)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(f"a cache layer ({type(layer).__name__}) holds no K/V tensors")
        shape = tuple(keys.shape)
        if (shape[0], shape[1], shape[3]) != expected or values.shape != keys.shape:
            raise ValueError(
                f"the model's cache holds K {shape} / V {tuple(values.shape)}; "
                f"kv_layout expected [1, {layout.kv_heads}, tokens, {layout.head_dim}]"
            )
        layers.append((keys, values))
    return layers


def _as_chunk(view: npt.NDArray[np.uint8], layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """An object's bytes as ``[layers, 2, kv_heads, tokens_per_chunk, head_dim]``."""
    if view.nbytes != layout.object_bytes():
        raise ValueError(
            f"an object has {view.nbytes} bytes; the layout says {layout.object_bytes()}"
        )
    with warnings.catch_warnings():  # frames from the wire are read-only: only read them
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(view)
    return data.view(dtype).view(
        layout.num_layers, 2, layout.kv_heads, layout.tokens_per_chunk, layout.head_dim
    )
