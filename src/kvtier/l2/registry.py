"""Adapters by type name, built from plain config mappings or JSON.

``make_adapter({"type": "fs", "path": "/var/cache/kvtier"}, on_complete)``.
Each entry names the module that holds the adapter; the module is imported
only when that type is configured, so a backend's client library (redis,
boto3, mooncake) is needed only by those who use it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from kvtier.config import from_mapping
from kvtier.l2.base import CompletionCallback, L2Adapter

ADAPTER_TYPES: dict[str, str] = {
    "fs": "kvtier.l2.fs:FSAdapter",
    "mock": "kvtier.l2.mock:MockAdapter",
    "mooncake": "kvtier.l2.mooncake:MooncakeAdapter",
    "redis": "kvtier.l2.redis:RedisAdapter",
    "s3": "kvtier.l2.s3:S3Adapter",
    "valkey": "kvtier.l2.redis:ValkeyAdapter",
}


def adapter_class(type_name: str) -> type[L2Adapter]:
    try:
        target = ADAPTER_TYPES[type_name]
    except KeyError:
        raise ValueError(
            f"unknown L2 adapter type {type_name!r}; choose one of {sorted(ADAPTER_TYPES)}"
        ) from None
    module, _, name = target.partition(":")
    cls: type[L2Adapter] = getattr(importlib.import_module(module), name)
    return cls


def parse_spec(spec: Mapping[str, Any] | str) -> dict[str, Any]:
    """A spec as a dict; JSON text is accepted (e.g. from a flag)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"L2 adapter spec is not valid JSON: {exc}") from None
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(f"an L2 adapter spec needs a 'type' (one of {sorted(ADAPTER_TYPES)})")
    return dict(spec)


def make_adapter(spec: Mapping[str, Any] | str, on_complete: CompletionCallback) -> L2Adapter:
    """Validate a spec and build the adapter; errors name the option to change."""
    options = parse_spec(spec)
    type_name = options.pop("type")
    cls = adapter_class(type_name)
    where = f"L2 adapter {options.get('name', type_name)!r} ({type_name})"
    config = from_mapping(cls.config_class, options, where)
    return cls(config, on_complete)  # type: ignore[call-arg]
