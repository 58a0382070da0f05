"""Every tier proves the layout before it serves (the one rule, in L1 too).

The finding: the cache server keyed objects by model, salt, rank and group
only, and L1 checked nothing else, so two clients of one model and tenant
whose layouts differ but whose objects have the same size read each other's
bytes as hits, where the fs tier (checking its header's layout digest)
missed. The engine adapters fold the layout into their chunk hashes; a
``CacheClient`` that does not is the exposure, and these clients do not.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.layout import KVLayout
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import ServerFactory, wait_for

CHUNK = 256
CHUNKS = 3
BASE = w.LAYOUT  # float16 K and V, 2 layers x 2 heads x 16
PAIRS = {  # a layout of BASE's object size that another engine could register
    "fp16-bf16": (BASE, p.LayoutSpec(0, 2, 2, 16, "bfloat16")),
    "canonical-engine-page": (BASE, p.LayoutSpec(0, 2, 2, 16, "float16", format="vllm-bs16")),
    "sglang-layer-first-page-first": (
        p.LayoutSpec(0, 2, 2, 16, "float16", format="sglang-layer_first"),
        p.LayoutSpec(0, 2, 2, 16, "float16", format="sglang-page_first"),
    ),
    "kv-mla-latent": (BASE, p.LayoutSpec(0, 2, 1, 64, "float16", kind="latent")),
    "exact-int8": (BASE, p.LayoutSpec(0, 2, 2, 16, "float16", lossy_codec="int8")),
}


def object_bytes(spec: p.LayoutSpec) -> int:
    layout = KVLayout(
        spec.num_layers,
        spec.kv_heads,
        spec.head_dim,
        spec.dtype,
        CHUNK,
        kind=spec.kind,  # type: ignore[arg-type]
        format=spec.format,
        lossy_codec=spec.lossy_codec,
    )
    return layout.object_bytes()


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "bytes"])
def test_a_client_of_another_layout_misses_what_one_stored(
    kvtier_server: ServerFactory, pair: str, shm: bool
) -> None:
    first, second = PAIRS[pair]
    size = object_bytes(first)
    assert object_bytes(second) == size  # same size: only the layout tells them apart
    server = kvtier_server.start()
    writer = CacheClient(w.client_config(server.rpc, layouts=(first,), shm=shm, client_id="a"))
    reader = CacheClient(w.client_config(server.rpc, layouts=(second,), shm=shm, client_id="b"))
    try:
        hashes = w.chunk_hashes(CHUNK, seed=3, n_chunks=CHUNKS)
        mine = w.payloads(3, CHUNKS, size)
        assert writer.store("w", hashes, mine) == CHUNKS

        state = reader.lookup("r", hashes, wait_s=10.0)
        assert (state.hit_chunks, state.miss_reason) == (0, "layout_mismatch")
        reader.end_session("r")
        theirs = w.payloads(4, CHUNKS, size)
        assert reader.store("r2", hashes, theirs) == 0  # the first layout keeps the keys

        state = writer.lookup("w2", hashes, wait_s=10.0)
        assert state.hit_chunks == CHUNKS
        out = w.empty_buffers(CHUNKS, size)
        assert writer.retrieve_into("w2", 0, CHUNKS, out)
        assert all(np.array_equal(a, b) for a, b in zip(out, mine, strict=True))
        writer.end_session("w2")

        status = wait_for(
            lambda: w.live_status(server.rpc),
            lambda s: s["storage"]["held_lookup_locks"] == 0,
        )
        assert status["storage"]["l1"]["wrong_layout"] >= 2 * CHUNKS
    finally:
        writer.close()
        reader.close()
