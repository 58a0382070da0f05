"""The mooncake L2 adapter against Mooncake's raw client, and two nodes
sharing the pool.

1. Store and load of N objects through ``MooncakeAdapter`` (header and
   payload as two parts of one object, zero copy from and into registered
   memory, the shared format's checksum) against ``MooncakeDistributedStore``
   doing the same work in the same run: ``batch_put_from`` and
   ``batch_get_into`` of the same bytes from registered memory.
2. Two ``kvtier serve`` nodes sharing the pool: node B's lookup-to-admitted
   latency for 32 chunks of 2 MiB (see ``shared_l2``).

Starts its own ``mooncake_master`` and a ``mooncake_client`` holding a 2 GB
segment (TCP, P2P handshake) and kvtier servers on 127.0.0.1.

    python benchmarks/bench_mooncake_adapter.py [--rounds 3] [--shapes 64x8,256x1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from common import timed
from kvtier.bench.stores import MooncakeProcess, mooncake_binaries
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter
from kvtier.l2.mooncake import MooncakeAdapter
from shared_l2 import compare_and_report, throughput


def adapter_vs_raw(
    server: MooncakeProcess, count: int, size: int, rounds: int, options: dict[str, Any]
) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore

    queue = CompletionQueue()
    adapter = make_adapter(server.spec(timeout_s=120, **options), queue.put)
    assert isinstance(adapter, MooncakeAdapter)
    raw: Any = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", server.address) == 0
    memory = np.random.default_rng(0).integers(0, 256, 2 * count * size, np.uint8)  # in, out
    adapter.register_memory(memory)  # as StorageManager does with the L1 arena
    assert raw.register_buffer(memory.ctypes.data, memory.nbytes) == 0
    buffers = [memory[i * size : (i + 1) * size] for i in range(count)]
    out = [memory[(count + i) * size : (count + i + 1) * size] for i in range(count)]
    ptrs, outs = [b.ctypes.data for b in buffers], [o.ctypes.data for o in out]
    sizes = [size] * count
    samples: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "put", "get")}
    try:
        for r in range(rounds):
            names = [f"bench/raw/{r}/{i}" for i in range(count)]
            keys = [ObjectKey(blake3(b"%d:%d" % (r, i)).digest(), "bench", 0) for i in range(count)]

            def through_adapter(task: Any, n: int = count) -> None:
                result = queue.get(timeout=600)
                assert result is not None and result.task == task, result
                assert result.count == n, (result.ok.count(False), adapter.status())

            samples["raw_put"].append(timed(lambda n=names: raw.batch_put_from(n, ptrs, sizes)))
            samples["put"].append(
                timed(lambda k=keys: through_adapter(adapter.submit_store(k, buffers)))
            )
            samples["raw_get"].append(timed(lambda n=names: raw.batch_get_into(n, outs, sizes)))
            samples["get"].append(
                timed(lambda k=keys: through_adapter(adapter.submit_load(k, out)))
            )
            assert all(np.array_equal(o, b) for o, b in zip(out, buffers, strict=True))
            raw.batch_remove(names, True)
            raw.batch_remove([adapter.name_of(k) for k in keys], True)
    finally:
        adapter.close()
        raw.close()
    return throughput(samples, count * size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--node-rounds", type=int, default=20)
    parser.add_argument("--shapes", default="64x8,256x1", help="COUNTxMIB,... (default 64x8,256x1)")
    parser.add_argument("--adapter", default="{}", help="adapter options as JSON")
    args = parser.parse_args()
    binaries = mooncake_binaries()
    if binaries is None:
        sys.exit("no mooncake_master: pip install mooncake-transfer-engine-non-cuda")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-mooncake-"))
    # The master's usual 5 s read lease: a 512 MiB batch outlives the tests' 200 ms.
    server = MooncakeProcess.start(binaries, tmp, segment="2GB", lease_ttl_ms=5000)
    options = json.loads(args.adapter)
    try:
        compare_and_report(
            "mooncake L2 adapter (Mooncake Store, TCP)",
            "Mooncake client",
            args.shapes,
            lambda count, size: adapter_vs_raw(server, count, size, args.rounds, options),
            server.spec(name="shared"),
            tmp,
            args.node_rounds,
            {"server": "mooncake", "rounds": args.rounds},
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
