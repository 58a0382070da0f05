"""SGLang HiCache page reads through kvtier against SGLang's own ``file`` backend.

Both backends sit under SGLang's own ``HiCacheController`` on CPU
(tests/integration/sglang_host.py), and each read goes through the
controller's own page read for that backend: ``batch_get_v1`` straight into
host pages for kvtier (``"interface_v1": 1``), ``batch_get`` into staging pages
then ``set_from_flat_data_page`` for ``file`` (SGLang's generic path). Same run,
same pages (``--pages`` pages of ``--page-size`` tokens, 8 layers, 8 KV heads,
head dim 128, bfloat16: 32 KiB a token), read in SGLang's batches of 128.

- *file*: HiCacheFile in a temporary directory, its files in the page cache
  (warmed by one unmeasured pass): the baseline.
- *kvtier L1 hit*: pages in the server's L1 (shared memory arena).
- *kvtier L2 hit*: the server restarted on its L2 directory: the first read
  of each page comes from L2 (local disk tier, page cache warm) into L1.
  After each restart the bench waits ``SETTLE_S`` for the new shared-memory
  arena to be mapped in the server and the client (start-up work that
  otherwise lands in the first read).

Prints GB/s and pages/s per case and each kvtier case's ratio to file.
Needs SGLang (the .ci/sglang virtualenv)::

    /work/sglang-venv/bin/python benchmarks/bench_sglang.py \
        [--pages 256] [--page-size 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.sglang_host import HostEngine, backend_config

from kvtier.process import ServerProcess

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
SETTLE_S = 5.0  # after a restart, for the new arena to be mapped


def read_all(engine: HostEngine, keys: list[str], target: Any) -> float:
    """Seconds for the controller's page read of every key into ``target``."""
    from sglang.srt.managers.cache_controller import PrefetchOperation

    controller, page = engine.controller, engine.page_size
    operation = PrefetchOperation("bench", [])
    start = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        batch = keys[i : i + BATCH]
        got = controller.page_get_func(operation, batch, target[i * page : (i + len(batch)) * page])
        if got != len(batch):
            raise RuntimeError(f"{engine.backend}: {got} of {len(batch)} pages read")
    return time.perf_counter() - start


def serve(directory: Path, page: int, l1_bytes: int, port: int = 0) -> ServerProcess:
    args = ["--host", "127.0.0.1", "--port", str(port), "--http-port", "0"]
    args += ["--l1-size", str(l1_bytes), "--cache-dir", str(directory / "l2")]
    args += ["--chunk-size", str(page)]
    return ServerProcess.start(args, directory / f"server-{time.monotonic_ns()}.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    page, pages = args.page_size, args.pages
    tokens = pages * page
    shape = {"layers": 8, "heads": 8, "head_dim": 128, "tokens": tokens * 2}
    prompt = list(range(10_000, 10_000 + tokens))
    directory = Path(tempfile.mkdtemp(prefix="bench-sglang-"))

    file_engine = HostEngine(
        page, "layer_first", "file", {"file_storage_path": str(directory / "file")}, **shape
    )
    source = file_engine.fill(tokens, seed=0)
    page_bytes = file_engine.host.get_dummy_flat_data_page().numel() * 2
    total = pages * page_bytes
    keys = file_engine.hashes(prompt)
    assert file_engine.write_back(prompt, source) == tokens
    target = file_engine.host.alloc(tokens)
    read_all(file_engine, keys, target)  # warm the page cache
    file_s = statistics.median(read_all(file_engine, keys, target) for _ in range(args.rounds))
    expected = file_engine.pages(source)
    assert file_engine.pages(target) == expected
    file_engine.close()

    l1_bytes = total + total // 4  # every page, and room to spare
    server = serve(directory, page, l1_bytes)
    engine = HostEngine(page, "layer_first", "dynamic", backend_config(server.rpc), **shape)
    source = engine.fill(tokens, seed=0)
    assert engine.write_back(prompt, source) == tokens
    target = engine.host.alloc(tokens)
    read_all(engine, keys, target)
    l1_s = statistics.median(read_all(engine, keys, target) for _ in range(args.rounds))
    assert engine.pages(target) == expected

    # L2: stop (write-back drained at SIGTERM), start on the same L2 directory.
    port = server.port
    l2_runs = []
    for _ in range(args.rounds):
        server.stop()
        server = serve(directory, page, l1_bytes, port)
        deadline = time.monotonic() + 60
        # Ready once a lookup hits (this promotes the first page to L1: 1 of --pages).
        while engine.storage.batch_exists(keys[:1]) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        # The new arena is mapped page by page on a thread in the server and in
        # this client (start-up work, not the read path): let that finish.
        time.sleep(SETTLE_S)
        l2_runs.append(read_all(engine, keys, target))
    assert engine.pages(target) == expected
    l2_s = statistics.median(l2_runs)
    engine.close()
    server.stop()

    print(
        f"{pages} pages of {page} tokens, {page_bytes / 2**20:.2f} MiB each, "
        f"median of {args.rounds} rounds"
    )
    for name, seconds in (("file", file_s), ("kvtier L1 hit", l1_s), ("kvtier L2 hit", l2_s)):
        line = f"  {name:14s} {total / seconds / 1e9:6.2f} GB/s  {pages / seconds:8.0f} pages/s"
        if name != "file":
            line += f"  x{file_s / seconds:.2f} of file"
        print(line)
    results = {
        "pages": pages,
        "page_bytes": page_bytes,
        "file_gb_s": total / file_s / 1e9,
        "l1_hit_gb_s": total / l1_s / 1e9,
        "l2_hit_gb_s": total / l2_s / 1e9,
        "l1_hit_x_file": file_s / l1_s,
        "l2_hit_x_file": file_s / l2_s,
    }
    print("json:", json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
