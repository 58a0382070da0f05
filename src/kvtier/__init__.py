"""kvtier: a tiered, shared KV-cache layer for LLM serving.

The public API is ``__all__``, each name loaded on first use, so ``import
kvtier`` costs nothing and the storage core (``kvtier.keys``,
``kvtier.layout``, ``kvtier.l1``, ``kvtier.storage``) needs only numpy and
blake3; heavy dependencies belong to optional extras and are imported where
they are used (``KVTierModel`` needs the ``hf`` extra, ``KVTierConnector``
vLLM).

- Engines: ``KVTierConnector`` (vLLM's KV connector), ``KVTierModel``
  (a transformers model with kvtier), ``ModelIdentity`` (what decides whose
  KV an engine may reuse).
- The node's cache server, from an engine: ``CacheClient``, ``ClientConfig``.
- In-process storage: ``StorageManager``, ``StorageConfig``.
- Keys: ``Namespace``, ``TokenHasher``, ``ObjectKey``, ``KVLayout``.
- Planning: ``make_plan``.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

_HOMES = {
    "CacheClient": "kvtier.protocol.client",
    "ClientConfig": "kvtier.protocol.client",
    "KVLayout": "kvtier.layout",
    "KVTierConnector": "kvtier.engine.vllm",
    "KVTierModel": "kvtier.engine.hf",
    "ModelIdentity": "kvtier.engine.identity",
    "Namespace": "kvtier.keys",
    "ObjectKey": "kvtier.keys",
    "StorageConfig": "kvtier.storage",
    "StorageManager": "kvtier.storage",
    "TokenHasher": "kvtier.keys",
    "make_plan": "kvtier.planner",
}

__all__ = ["__version__", *sorted(_HOMES)]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
