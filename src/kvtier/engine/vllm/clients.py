"""One ``CacheClient`` per tenant salt, and the chunk hashers that go with them.

The server builds object keys from the salt a client registered with, so a
connector that serves several tenants (requests with different ``cache_salt``)
keeps one client per salt, made on first use. Both sides of the connector use
this: the scheduler's clients speak for every TP rank (a lookup hits only
chunks all ranks have), each worker's for its own rank.

A salt here is the tenant's salt as the request gave it (``salt_for``); the
engine identity labels it, once, for the client's registration
(``ModelIdentity.label``) and for its hashes (``ModelIdentity.namespace``),
as the transformers integration and the router do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.engine.identity import ModelIdentity
from kvtier.engine.identity import model_identity as identity_of
from kvtier.engine.vllm.groups import CacheGroups
from kvtier.engine.vllm.pages import engine_kv_layout
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.keys import TokenHasher
from kvtier.layout import KVLayout
from kvtier.layout.reshard import tp_layout
from kvtier.protocol.client import CacheClient, ClientConfig
from kvtier.protocol.messages import LayoutSpec


def model_identity(vllm_config: Any, settings: ConnectorSettings) -> ModelIdentity:
    """``identity.model_identity`` for the model vLLM serves: its path or hub
    id, ``kvtier.revision`` (else the model config's, else the hub commit or
    the checkpoint files' fingerprint) and its HF config, by the same rules
    as the transformers integration."""
    model = vllm_config.model_config
    return identity_of(
        model.model, model.hf_config.to_dict(), revision=settings.revision or model.revision
    )


class ClientPool:
    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        rank: int,
        client_id: str,
        connect_wait_s: float | None = None,
        kv_cache_config: Any = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.client_id = client_id
        self.connect_wait_s = connect_wait_s  # how long a new client may wait for its HELLO
        self.identity = model_identity(vllm_config, settings)
        self.block_size: int = vllm_config.cache_config.block_size
        self.groups = CacheGroups.of(kv_cache_config, self.block_size)
        probe = engine_kv_layout(vllm_config, self.block_size)  # validates the model up front
        window = (self.groups.window_layers(), self.groups.window_tokens())
        self.spec = LayoutSpec.of(probe, 0, *window)
        self.num_ranks = probe.num_ranks
        # The rank whose objects this pool's clients read and write (-1: every
        # rank's). An MLA layout has one rank: every TP rank reads rank 0's
        # objects, and only TP rank 0 writes them (the others are replicas).
        self.rank = min(rank, probe.num_ranks - 1)
        self.replica = self.rank != rank
        self.kv_heads: int = vllm_config.model_config.get_total_num_kv_heads()
        self._clients: dict[str, CacheClient] = {}
        self._hashers: dict[tuple[str, int, int, str], TokenHasher] = {}
        self._layouts: dict[int, KVLayout] = {}

    def client(self, salt: str) -> CacheClient | None:
        """The client of ``salt``, or None while the server is away (each
        client reconnects on its own I/O thread: nothing here waits for it)."""
        client = self._clients.get(salt)
        if client is None:
            label = self._identity(salt).label
            client = self._clients[salt] = CacheClient(
                ClientConfig(
                    address=self.settings.address,
                    model=label.model,
                    hash_model=self.identity.model,
                    layouts=(self.spec,),
                    num_ranks=self.num_ranks,
                    rank=self.rank,
                    block_alignment=self.block_size,
                    revision=self.identity.revision,
                    salt=label.salt,
                    auth_token=self.settings.auth_token,
                    client_id=self.client_id,
                    request_timeout_s=self.settings.request_timeout_s,
                ),
                self.connect_wait_s,
            )
        return None if client.degraded else client

    def awaiting_hello(self, salt: str) -> bool:
        """Whether the client of ``salt`` (made now if new) has its first HELLO
        out while the server answers this pool's other clients: its answer
        is coming (a new tenant's HELLO can take longer than the lookup
        budget on a busy node), so a request may wait a step for it. With no
        client registered the server is taken to be away: nothing waits."""
        self.client(salt)
        pending = self._clients[salt].registering
        return pending and any(not client.degraded for client in self._clients.values())

    def layout(self, chunk_size: int) -> KVLayout:
        if chunk_size not in self._layouts:
            self._layouts[chunk_size] = engine_kv_layout(self.vllm_config, chunk_size, self.groups)
        return self._layouts[chunk_size]

    def hasher(
        self, salt: str, chunk_size: int, ranks: int = 0, page_format: str = ""
    ) -> TokenHasher:
        """Chunk hashes of this engine's namespace, or of the same model under
        TP ``ranks`` and pages in ``page_format`` (a producer's, in a
        hand-off; ValueError if TP ``ranks`` cannot split the model's KV
        heads)."""
        own = self.layout(chunk_size)
        key = (salt, chunk_size, ranks or self.num_ranks, page_format or own.format)
        if key not in self._hashers:
            identity = self._identity(salt)
            layout = own
            if ranks and ranks != self.num_ranks:
                layout = tp_layout(layout, self.kv_heads, ranks)
            if page_format and page_format != own.format:
                layout = dataclasses.replace(layout, format=page_format)
            self._hashers[key] = TokenHasher(identity.namespace(layout), chunk_size)
        return self._hashers[key]

    def _identity(self, salt: str) -> ModelIdentity:
        """This engine's identity for the tenant of ``salt`` (as given)."""
        return dataclasses.replace(self.identity, salt=salt)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
