"""The namespace that roots every chunk-hash chain.

Two requests can share KV only if they run the same model weights, with the
same adapter, KV dtype and KV layout, for the same tenant. All of that is the
namespace; its canonical JSON seeds the hash chain (see ``kvtier.keys.hasher``),
so a change in any field gives disjoint keys: a miss, never a misread.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that decides what a chunk's KV is.

    model: the model's name (e.g. ``"meta-llama/Llama-3.1-8B"``).
    revision: the weights' revision or checksum.
    lora: the LoRA adapter id, empty for the base model.
    kv_dtype: the dtype the KV is stored in (``"bfloat16"``...).
    layout: the ``KVLayout.digest()`` of the object group(s).
    salt: the tenant's cache salt. Isolation, not authentication.
    """

    model: str
    revision: str = ""
    lora: str = ""
    kv_dtype: str = ""
    layout: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, str):
                raise TypeError(f"Namespace.{field.name} must be a str, got {type(value).__name__}")
        if not self.model:
            raise ValueError("Namespace.model must not be empty: pass the model's name")

    def canonical_json(self) -> bytes:
        """JSON with sorted keys, no spaces, UTF-8, all six fields present."""
        return json.dumps(
            dataclasses.asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")
