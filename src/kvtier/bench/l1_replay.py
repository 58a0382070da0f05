"""A trace's block accesses replayed through a real ``kvtier serve``: the
planner's error bar.

Each request is what an engine does: a LOOKUP of its blocks' chunk hashes
(through ``CacheClient``), the hit run read back and its locks released,
then a STORE of every block after the hit run (synthetic KV of one size;
the server skips those it has). The server runs with L1 only (no L2), an L1
of whole objects, and ``l1.high_watermark=1.0`` so that it evicts only when
a write needs the room, as ``kvtier.planner.policy_sim`` models it. A block
id becomes the chunk hash whose policy fingerprint is that id, so the
probation policy samples the same blocks in the server as in the planner.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.planner.policy_sim import requests
from kvtier.planner.reuse import Access
from kvtier.process import ServerProcess
from kvtier.protocol.client import CacheClient, ClientConfig
from kvtier.protocol.messages import LayoutSpec

CHUNK_TOKENS = 256  # the server's chunk size (any: the hashes are given)
HEAD_DIM = 8  # one layer, one KV head, uint8: 256 x 2 x 8 = 4 KiB an object
OBJECT_BYTES = CHUNK_TOKENS * 2 * HEAD_DIM


def block_hash(block: int) -> bytes:
    """The chunk hash that stands for trace block ``block``."""
    return block.to_bytes(8, "little") + bytes(24)


@dataclass(frozen=True, slots=True)
class ServerReplay:
    """What the server answered: each request's hit run (blocks)."""

    capacity_blocks: int
    hit_runs: list[int]


def replay_through_server(
    touches: Sequence[Access], policy: str, capacity_blocks: int, work: Path | None = None
) -> ServerReplay:
    """Replay ``touches`` through a fresh ``kvtier serve`` whose L1 holds
    ``capacity_blocks`` objects under eviction policy ``policy``."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        args = ["--port", "0", "--http-port", "0", "--cache-dir", "none"]
        args += ["--l1-size", str(capacity_blocks * OBJECT_BYTES)]
        args += ["--chunk-size", str(CHUNK_TOKENS)]
        args += ["--set", "l1.high_watermark=1.0", "--set", "l1.low_watermark=0.99"]
        args += ["--set", f"l1.eviction_policy={policy}"]
        with ServerProcess.start(args, Path(tmp) / "kvtier.log") as server:
            capacity = server.status_json()["storage"]["l1"]["capacity_bytes"] // OBJECT_BYTES
            if capacity != capacity_blocks:
                raise RuntimeError(f"L1 holds {capacity} objects, not {capacity_blocks}")
            return ServerReplay(capacity, _replay(server.rpc, touches))


def _replay(address: str, touches: Sequence[Access]) -> list[int]:
    layout = LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=HEAD_DIM, dtype="uint8")
    config = ClientConfig(
        address=address,
        model="replay/model",
        layouts=(layout,),
        client_id="replay",
        request_timeout_s=60.0,
    )
    client = CacheClient(config)
    payload = np.zeros(OBJECT_BYTES, np.uint8)
    runs = []
    try:
        for number, request in enumerate(requests(touches)):
            hashes = [block_hash(access.block) for access in request]
            name = f"r{number}"
            hits = client.query(client.lookup(name, hashes), timeout_s=60.0) or 0
            client.end_session(name)  # the hit run's locks go with the session
            runs.append(hits)
            if hits < len(hashes):
                client.store(f"w{number}", hashes[hits:], [payload] * (len(hashes) - hits))
    finally:
        client.close()
    return runs


__all__ = ["OBJECT_BYTES", "ServerReplay", "block_hash", "replay_through_server"]
