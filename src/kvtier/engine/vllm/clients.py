"""One ``CacheClient`` per tenant salt, and the chunk hashers that go with them.

The server builds object keys from the salt a client registered with, so a
connector that serves several tenants (requests with different ``cache_salt``)
keeps one client per salt, made on first use. Both sides of the connector use
this: the scheduler's clients speak for every TP rank (a lookup hits only
chunks all ranks have), each worker's for its own rank.
"""

from __future__ import annotations

import json
from typing import Any

from blake3 import blake3

from kvtier.engine.link import ModelIdentity
from kvtier.engine.vllm.pages import engine_kv_layout
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.keys import TokenHasher, model_label
from kvtier.keys.object_key import MAX_MODEL_CHARS
from kvtier.layout import KVLayout
from kvtier.server.client import CacheClient, ClientConfig
from kvtier.server.protocol import LayoutSpec


def model_identity(vllm_config: Any, settings: ConnectorSettings) -> ModelIdentity:
    """The model's name (its path or hub id; hashed when too long for a key),
    and revision: ``kvtier.revision``, else the model config's, then a
    fingerprint of the HF config (the same weights with another RoPE base
    compute other KV)."""
    model = vllm_config.model_config
    name = model.model
    if len(model_label(name)) > MAX_MODEL_CHARS:
        name = "m-" + blake3(name.encode()).hexdigest(length=16)
    revision = settings.revision or model.revision or ""
    config = json.dumps(model.hf_config.to_diff_dict(), sort_keys=True, default=repr)
    return ModelIdentity(
        model=name, revision=f"{revision}+c-{blake3(config.encode()).hexdigest(length=8)}"
    )


class ClientPool:
    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        rank: int,
        client_id: str,
        connect_wait_s: float | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.rank = rank
        self.client_id = client_id
        self.connect_wait_s = connect_wait_s  # how long a new client may wait for its HELLO
        self.identity = model_identity(vllm_config, settings)
        self.block_size: int = vllm_config.cache_config.block_size
        probe = engine_kv_layout(vllm_config, self.block_size)  # validates the model up front
        self.spec = LayoutSpec(
            group=0,
            num_layers=probe.num_layers,
            kv_heads=probe.kv_heads,
            head_dim=probe.head_dim,
            dtype=probe.dtype,
            format=probe.format,
        )
        self.num_ranks = probe.num_ranks
        self._clients: dict[str, CacheClient] = {}
        self._hashers: dict[tuple[str, int], TokenHasher] = {}

    def client(self, salt: str) -> CacheClient | None:
        """The client of ``salt``, or None while the server is away (each
        client reconnects on its own I/O thread: nothing here waits for it)."""
        client = self._clients.get(salt)
        if client is None:
            client = self._clients[salt] = CacheClient(
                ClientConfig(
                    address=self.settings.address,
                    model=model_label(self.identity.model),
                    layouts=(self.spec,),
                    num_ranks=self.num_ranks,
                    rank=self.rank,
                    block_alignment=self.block_size,
                    revision=self.identity.revision,
                    salt=salt,
                    auth_token=self.settings.auth_token,
                    client_id=self.client_id,
                    request_timeout_s=self.settings.request_timeout_s,
                ),
                self.connect_wait_s,
            )
        return None if client.degraded else client

    def layout(self, chunk_size: int) -> KVLayout:
        return engine_kv_layout(self.vllm_config, chunk_size)

    def hasher(self, salt: str, chunk_size: int) -> TokenHasher:
        key = (salt, chunk_size)
        if key not in self._hashers:
            identity = ModelIdentity(
                model=self.identity.model, revision=self.identity.revision, salt=salt
            )
            namespace = identity.namespace(self.layout(chunk_size))
            self._hashers[key] = TokenHasher(namespace, chunk_size)
        return self._hashers[key]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
