"""The vLLM KV connector: ``KVTierConnector``, loaded by vLLM from
``kv_connector_module_path="kvtier.engine.vllm"``. Only the connector itself
imports vLLM, on first use, so the parts (settings, pages) load without it."""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.engine.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
