"""The cache server end to end: shared-memory and bytes paths, lookup latency,
and concurrent clients. Starts ``kvtier serve`` (and, for the bytes-path
baseline, a raw ZeroMQ ROUTER) as subprocesses on 127.0.0.1.

- shm path: ``CacheClient.store`` (reserve, copy into the arena, commit) and
  lookup + ``retrieve_into`` (copy out of the arena, release), against
  ``numpy.copyto`` of the same bytes in the same run.
- bytes path (``shm=False``): the same through ZeroMQ frames, against a raw
  DEALER sending the same frames to a ROUTER that only answers "ok".
- LOOKUP -> answer for a 128-chunk prompt all in L1: p50/p99 (WAIT).
- N concurrent client processes storing and retrieving: aggregate GB/s and
  p99 per operation.

    python benchmarks/bench_server.py [--objects 16] [--object-mib 8] [--clients 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from common import percentile, random_objects, report, timed
from kvtier.keys import Namespace, TokenHasher
from kvtier.process import ServerProcess
from kvtier.protocol.client import CacheClient, ClientConfig
from kvtier.protocol.messages import LayoutSpec

RAW_ROUTER = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    s.send_multipart([frames[0].bytes, b"ok"])
"""


def client(address: str, shm: bool, name: str, head_dim: int) -> CacheClient:
    layout = LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=head_dim, dtype="uint8")
    return CacheClient(
        ClientConfig(
            address=address,
            model="bench/model",
            layouts=(layout,),
            client_id=name,
            shm=shm,
            request_timeout_s=30,
        )
    )


def hashes_for(seed: int, chunks: int, chunk_size: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 2**31, chunks * chunk_size, dtype=np.uint32)
    return TokenHasher(Namespace("bench/model"), chunk_size).chunk_hashes(tokens)


def roundtrip(
    c: CacheClient, seed: int, sources: list[np.ndarray], outs: list[np.ndarray]
) -> tuple[float, float]:
    assert c.chunk_size is not None
    hashes = hashes_for(seed, len(sources), c.chunk_size)
    store_s = timed(lambda: c.store(f"s{seed}", hashes, sources))
    c.end_session(f"s{seed}")

    def get() -> None:
        state = c.lookup(f"g{seed}", hashes)
        hit = c.query(state, timeout_s=10)
        assert hit == len(hashes), hit
        assert c.retrieve_into(f"g{seed}", 0, hit, outs)
        c.end_session(f"g{seed}")

    return store_s, timed(get)


def gbs(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def raw_send_seconds(port: str, frames: list[np.ndarray], rounds: int) -> float:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def send() -> None:
        sock.send_multipart([b"x", *frames], copy=False)
        sock.recv()

    seconds = statistics.median(timed(send) for _ in range(rounds))
    sock.close(linger=0)
    return seconds


def worker(address: str, index: int, objects: int, size: int, rounds: int, out: mp.Queue) -> None:
    c = client(address, True, f"w{index}", size // 512)
    sources = random_objects(objects, size, seed=index)
    outs = [np.ones(size, np.uint8) for _ in range(objects)]
    times = [roundtrip(c, 1000 * index + r, sources, outs) for r in range(rounds)]
    c.close()
    out.put(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=16)
    parser.add_argument("--object-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--lookups", type=int, default=300)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-server-")
    server = ServerProcess.start(
        ["--port", "0", "--http-port", "-1", "--l1-size", "2GiB", "--cache-dir", "none"],
        Path(tmp) / "server.log",
    )
    address = server.rpc
    raw = subprocess.Popen([sys.executable, "-c", RAW_ROUTER], stdout=subprocess.PIPE, text=True)
    try:
        # One chunk of 256 tokens, 1 layer, 1 head, uint8: K+V = 512 * head_dim bytes.
        size = args.object_mib << 20
        head_dim = size // 512
        total = args.objects * size
        sources = random_objects(args.objects, size)
        outs = [np.ones(size, np.uint8) for _ in range(args.objects)]
        memcpy = statistics.median(
            timed(lambda: [np.copyto(o, s) for s, o in zip(sources, outs, strict=True)])
            for _ in range(args.rounds)
        )
        results: dict[str, object] = {"object_bytes": size, "objects": args.objects}
        rows = [("numpy.copyto baseline", f"{total / memcpy / 1e9:.2f} GB/s")]
        for shm in (True, False):
            c = client(address, shm, f"main-{shm}", head_dim)
            seeds = [r + (100 if shm else 200) for r in range(args.rounds + 1)]
            times = [roundtrip(c, seed, sources, outs) for seed in seeds][1:]  # 1 warm-up
            c.close()
            assert all(np.array_equal(s, o) for s, o in zip(sources, outs, strict=True))
            put = statistics.median(t[0] for t in times)
            get = statistics.median(t[1] for t in times)
            name = "shm" if shm else "bytes"
            results[f"{name}_store_gbs"] = total / put / 1e9
            results[f"{name}_retrieve_gbs"] = total / get / 1e9
            if shm:
                results["shm_store_ratio"] = memcpy / put
                results["shm_retrieve_ratio"] = memcpy / get
                rows.append(
                    ("shm store", f"{total / put / 1e9:.2f} GB/s = {memcpy / put:.2f}x memcpy")
                )
                rows.append(
                    (
                        "shm lookup+retrieve",
                        f"{total / get / 1e9:.2f} GB/s = {memcpy / get:.2f}x memcpy",
                    )
                )
            else:
                assert raw.stdout is not None
                base = raw_send_seconds(raw.stdout.readline().strip(), sources, args.rounds)
                results["raw_zmq_gbs"] = total / base / 1e9
                results["bytes_store_ratio"] = base / put
                results["bytes_retrieve_ratio"] = base / get
                rows.append(("raw ZeroMQ send baseline", f"{total / base / 1e9:.2f} GB/s"))
                rows.append(
                    ("bytes store", f"{total / put / 1e9:.2f} GB/s = {base / put:.2f}x raw")
                )
                rows.append(
                    (
                        "bytes lookup+retrieve",
                        f"{total / get / 1e9:.2f} GB/s = {base / get:.2f}x raw",
                    )
                )

        # LOOKUP -> answer, 128 chunks all in L1.
        small = client(address, True, "lookup", 8)  # 4 KiB objects
        assert small.chunk_size is not None
        hashes = hashes_for(7, 128, small.chunk_size)
        small.store("seed", hashes, [np.zeros(4096, np.uint8)] * 128)
        lat, piped = [], []
        for i in range(args.lookups):
            start = time.perf_counter()
            state = small.lookup(f"l{i}", hashes)
            hit = small.query(state, timeout_s=5)
            lat.append(time.perf_counter() - start)
            assert hit == 128
            small.end_session(f"l{i}")
            start = time.perf_counter()
            state = small.lookup(f"p{i}", hashes, wait_s=5)  # LOOKUP and WAIT pipelined
            piped.append(time.perf_counter() - start)
            assert state.hit_chunks == 128
            small.end_session(f"p{i}")
        small.close()
        results["lookup128_p50_s"] = percentile(lat, 50)
        results["lookup128_p99_s"] = percentile(lat, 99)
        results["lookup128_pipelined_p50_s"] = percentile(piped, 50)
        results["lookup128_pipelined_p99_s"] = percentile(piped, 99)
        for name, samples in (("LOOKUP, then WAIT", lat), ("LOOKUP+WAIT pipelined", piped)):
            p50, p99 = percentile(samples, 50) * 1e3, percentile(samples, 99) * 1e3
            rows.append((f"{name}, 128 chunks in L1", f"p50 {p50:.2f} ms, p99 {p99:.2f} ms"))

        # Concurrent clients.
        spawn = mp.get_context("spawn")  # ZeroMQ contexts do not survive fork
        queue: mp.Queue[list[tuple[float, float]]] = spawn.Queue()
        per_client = max(1, args.objects // 4)
        procs = [
            spawn.Process(target=worker, args=(address, i, per_client, size, args.rounds, queue))
            for i in range(args.clients)
        ]
        start = time.perf_counter()
        for proc in procs:
            proc.start()
        all_times = [queue.get(timeout=300) for _ in procs]
        wall = time.perf_counter() - start
        for proc in procs:
            proc.join()
        moved = 2 * args.clients * args.rounds * per_client * size
        ops = [t for times in all_times for pair in times for t in pair]
        results["concurrent_clients"] = args.clients
        results["concurrent_gbs"] = moved / wall / 1e9
        results["concurrent_op_p99_s"] = percentile(ops, 99)
        rows.append(
            (
                f"{args.clients} clients, {per_client} x {args.object_mib} MiB per op",
                f"{gbs(moved, wall)} aggregate (store+retrieve), "
                f"op p99 {percentile(ops, 99) * 1e3:.1f} ms",
            )
        )
    finally:
        raw.kill()
        server.stop(timeout_s=20)
        shutil.rmtree(tmp)
    report("cache server end to end", rows, results)


if __name__ == "__main__":
    main()
