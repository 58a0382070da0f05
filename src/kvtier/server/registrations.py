"""``Registrations``: what the cache server remembers of the clients that
registered, for ``/status``, after they are gone.

Two small most-recent-first tables, each of at most ``REMEMBERED`` entries:
the layouts of each namespace (``kvtier plan --from-server`` reads them), and
the namespaces a router needs to hash prompts as the clients do
(docs/hashing.md), the salt left out.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from typing import TypeVar

from kvtier.keys import NamespaceLabel
from kvtier.layout import KVLayout
from kvtier.protocol import messages as p
from kvtier.server.sessions import Client

REMEMBERED = 64  # namespaces whose layouts (and hash namespaces) /status shows
Name = TypeVar("Name", NamespaceLabel, str)


class Registrations:
    """See the module docstring."""

    def __init__(self) -> None:
        self._layouts: OrderedDict[NamespaceLabel, dict[str, object]] = OrderedDict()
        self._hash_namespaces: OrderedDict[str, dict[str, object]] = OrderedDict()

    def registered(
        self, client: Client, hello: p.Hello, layouts: dict[int, KVLayout], chunk_size: int
    ) -> None:
        """Remember an accepted HELLO's namespace, layouts and hash namespace."""
        _remember(
            self._layouts,
            NamespaceLabel.of(client),
            {str(group): dataclasses.asdict(layout) for group, layout in client.layouts.items()},
        )
        entry = hash_namespace(hello, layouts, chunk_size)
        _remember(self._hash_namespaces, json.dumps(entry, sort_keys=True), entry)

    def layouts(self) -> dict[str, dict[str, object]]:
        """Namespace (its text form, ``model@salt``) -> its layouts by group,
        oldest first."""
        return {str(namespace): layouts for namespace, layouts in self._layouts.items()}

    def hash_namespaces(self) -> list[dict[str, object]]:
        return list(self._hash_namespaces.values())


def hash_namespace(
    hello: p.Hello, layouts: dict[int, KVLayout], chunk_size: int
) -> dict[str, object]:
    """The namespace of a client's chunk hashes, salt aside: its model
    (``hash_model``, else ``model``), revision and LoRA, and the dtype and
    digest of its first group's layout (what ``ModelIdentity.namespace``
    builds from the engine's layout)."""
    first = layouts[min(layouts)]
    return {
        "model": hello.hash_model or hello.model,
        "revision": hello.revision,
        "lora": hello.lora,
        "kv_dtype": first.dtype,
        "layout": first.digest(),
        "chunk_size": chunk_size,
    }


def _remember(
    table: OrderedDict[Name, dict[str, object]], name: Name, entry: dict[str, object]
) -> None:
    table.pop(name, None)
    table[name] = entry
    while len(table) > REMEMBERED:
        table.popitem(last=False)


__all__ = ["REMEMBERED", "Registrations", "hash_namespace"]
