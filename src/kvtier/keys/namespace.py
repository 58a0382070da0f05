"""The namespace that roots every chunk-hash chain.

Two requests can share KV only if they run the same model weights, with the
same adapter, KV dtype and KV layout, for the same tenant. All of that is the
namespace; its canonical JSON seeds the hash chain (see ``kvtier.keys.hasher``),
so a change in any field gives disjoint keys: a miss, never a misread.

Every engine and the router build it with ``key_namespace``, from the salt as
the tenant gave it: the one place the salt is labelled for hashing, so that
they all hash the same form and name the same prefix with the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvtier.keys.label import is_salt_label, salt_label


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that decides what a chunk's KV is.

    model: the model's name (e.g. ``"meta-llama/Llama-3.1-8B"``).
    revision: the weights' revision or checksum.
    lora: the LoRA adapter id, empty for the base model.
    kv_dtype: the dtype the KV is stored in (``"bfloat16"``...).
    layout: the ``KVLayout.digest()`` of the object group(s).
    salt: the tenant's cache salt as a key label (``salt_label``, which
    ``key_namespace`` applies), the salt its keys carry too. Isolation, not
    authentication. A salt that is not a label is refused: it is a salt
    nobody labelled, which no other engine would hash alike.
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
        if not is_salt_label(self.salt):
            raise ValueError(
                f"Namespace.salt {self.salt!r} is not a salt label; build the namespace with "
                "key_namespace(), which labels the tenant's salt"
            )

    def canonical_json(self) -> bytes:
        """JSON with sorted keys, no spaces, UTF-8, all six fields present."""
        return json.dumps(
            dataclasses.asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")


def key_namespace(
    model: str,
    *,
    revision: str = "",
    lora: str = "",
    kv_dtype: str = "",
    layout: str = "",
    salt: str = "",
) -> Namespace:
    """The namespace of a tenant's chunk hashes. ``salt`` is the salt as the
    tenant gave it (a request's ``cache_salt``, an engine's ``salt=``), never
    a label: it is labelled here, once (``salt_label`` of a label is another
    label). ``model`` is the model's full name (not its label: the hash
    covers the name, the key carries the label)."""
    return Namespace(
        model=model,
        revision=revision,
        lora=lora,
        kv_dtype=kv_dtype,
        layout=layout,
        salt=salt_label(salt),
    )
