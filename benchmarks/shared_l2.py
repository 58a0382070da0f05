"""What the shared-L2 benchmarks share: two ``kvtier serve`` nodes with
separate L1s sharing one L2 store (node B's lookup-to-admitted latency for
chunks node A stored), the adapter-vs-raw-client throughput summary, and the
report that puts both together."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common import percentile, report
from kvtier.keys import Namespace, TokenHasher
from kvtier.layout import KVLayout
from kvtier.process import ServerProcess
from kvtier.protocol.client import CacheClient, ClientConfig
from kvtier.protocol.messages import LayoutSpec

MiB = 1 << 20
# 8 layers, 2 KV heads of 128, bf16: 8 KiB per token, 2 MiB per 256-token chunk.
SPEC = LayoutSpec(group=0, num_layers=8, kv_heads=2, head_dim=128, dtype="bfloat16")


def _stored_in_shared(client: CacheClient) -> int:
    """Objects node A's write-back has put in the L2 named ``shared``."""
    status = client.status()
    assert status is not None, "node A did not answer STATUS"
    return int(status.storage.store.stored_objects.get("shared", 0))


def two_nodes(shared: dict[str, Any], tmp: Path, rounds: int) -> dict[str, float]:
    """Node A stores 32 chunks; node B's lookup-to-admitted latency, its L1
    cleared before every round. ``shared`` is the L2 spec (named ``shared``)."""
    spec = json.dumps(shared)
    args = ["--port", "0", "--http-port", "0", "--l1-size", "512MiB", "--cache-dir", "none"]
    with (
        ServerProcess.start([*args, "--l2", spec], tmp / "a.log") as a,
        ServerProcess.start([*args, "--l2", spec], tmp / "b.log") as b,
    ):
        config = {"model": "bench/model", "layouts": (SPEC,), "salt": f"b{time.time_ns()}"}
        on_a = CacheClient(ClientConfig(address=a.rpc, **config))
        on_b = CacheClient(ClientConfig(address=b.rpc, **config))
        chunk = on_a.chunk_size
        assert chunk is not None
        layout = KVLayout(SPEC.num_layers, SPEC.kv_heads, SPEC.head_dim, SPEC.dtype, chunk)
        namespace = Namespace("bench/model", kv_dtype=SPEC.dtype, layout=layout.digest())
        hashes = TokenHasher(namespace, chunk).chunk_hashes(list(range(32 * chunk)))
        data = [np.full(layout.object_bytes(), i, np.uint8) for i in range(32)]
        assert on_a.store("s", hashes, data) == 32
        while _stored_in_shared(on_a) < 32:
            time.sleep(0.05)
        latencies = []
        for r in range(rounds):
            clear = urllib.request.Request(b.http + "/clear", method="POST")
            urllib.request.urlopen(clear, timeout=10).read()
            started = time.perf_counter()
            state = on_b.lookup(f"r{r}", hashes, wait_s=30.0)
            latencies.append(time.perf_counter() - started)
            assert state.hit_chunks == 32 and state.chunks_by_tier == {"shared": 32}, state
            on_b.end_session(f"r{r}")
        on_a.close()
        on_b.close()
    return {
        "chunks": 32,
        "object_bytes": layout.object_bytes(),
        "lookup_to_admitted_p50_s": percentile(latencies, 50),
        "lookup_to_admitted_p95_s": percentile(latencies, 95),
    }


def throughput(samples: dict[str, list[float]], total: int) -> dict[str, float]:
    """GB/s of ``put``/``get`` through an adapter and ``raw_put``/``raw_get``
    through its raw client (median seconds), and the median per-round ratio."""

    def ratio(raw_name: str, name: str) -> float:
        pairs = zip(samples[raw_name], samples[name], strict=True)
        return statistics.median([r / a for r, a in pairs])

    return {
        **{f"{k}_gbs": total / statistics.median(v) / 1e9 for k, v in samples.items()},
        "put_ratio": ratio("raw_put", "put"),
        "get_ratio": ratio("raw_get", "get"),
    }


def compare_and_report(
    title: str,
    raw_client: str,
    shapes: str,
    measure: Callable[[int, int], dict[str, float]],
    shared: dict[str, Any],
    tmp: Path,
    node_rounds: int,
    results: dict[str, object],
) -> None:
    """``measure(count, object_bytes)`` for each ``COUNTxMIB`` of ``shapes``, then
    ``two_nodes`` over the ``shared`` spec; prints the table and the JSON line."""
    rows: list[tuple[str, str]] = []
    for shape in shapes.split(","):
        count, mib = (int(x) for x in shape.split("x"))
        r = measure(count, mib * MiB)
        results[f"{count}x{mib}MiB"] = r
        rows.append(
            (
                f"{count} x {mib} MiB store / load",
                f"{r['put_gbs']:.2f} / {r['get_gbs']:.2f} GB/s = {r['put_ratio']:.2f}x / "
                f"{r['get_ratio']:.2f}x raw {raw_client} ({r['raw_put_gbs']:.2f} / "
                f"{r['raw_get_gbs']:.2f} GB/s)",
            )
        )
    nodes = two_nodes(shared, tmp, node_rounds)
    results["two_nodes"] = nodes
    rows.append(
        (
            "node B lookup -> admitted, 32 x 2 MiB from the store",
            f"p50 {nodes['lookup_to_admitted_p50_s'] * 1e3:.1f} ms, "
            f"p95 {nodes['lookup_to_admitted_p95_s'] * 1e3:.1f} ms",
        )
    )
    report(title, rows, results)
