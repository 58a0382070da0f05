"""fs adapter store and load of N x 8 MiB objects, against plain Python file I/O.

Baseline in the same run, same directory, same bytes: for each object
``open(path, "wb").write(buffer)`` and ``open(path, "rb").readinto(buffer)``.
The adapter adds a header, an xxh3 checksum, a temp-file-and-rename publish
and its thread pool. Reads are page-cache warm for both; every store writes
fresh files (the previous round's are deleted untimed).

    python benchmarks/bench_fs_adapter.py [--objects 64] [--object-mib 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from common import report, timed
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--object-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    args = parser.parse_args()

    size = args.object_mib << 20
    total = args.objects * size
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.dir))
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.objects)]
    outputs = [np.ones(size, dtype=np.uint8) for _ in range(args.objects)]
    keys = [ObjectKey(i.to_bytes(32, "big"), "bench", 0) for i in range(args.objects)]
    plain = root / "plain"
    completions = CompletionQueue()
    adapter = make_adapter({"type": "fs", "path": str(root / "fs")}, completions.put)

    def plain_store() -> float:
        shutil.rmtree(plain, ignore_errors=True)
        plain.mkdir()

        def write() -> None:
            for i, src in enumerate(sources):
                with open(plain / f"{i}.bin", "wb") as f:
                    f.write(src)

        return timed(write)

    def plain_load() -> float:
        def read() -> None:
            for i, dst in enumerate(outputs):
                with open(plain / f"{i}.bin", "rb") as f:
                    f.readinto(dst)

        return timed(read)

    def run(submit: object) -> None:
        submit()  # type: ignore[operator]
        result = completions.get(timeout=120)
        assert result is not None and all(result.ok), result

    def fs_store() -> float:
        shutil.rmtree(root / "fs" / "00", ignore_errors=True)
        return timed(lambda: run(lambda: adapter.submit_store(keys, sources)))

    def fs_load() -> float:
        return timed(lambda: run(lambda: adapter.submit_load(keys, outputs)))

    try:
        plain_store(), fs_store(), plain_load(), fs_load()  # warm-up
        rounds = [(plain_store(), fs_store(), plain_load(), fs_load()) for _ in range(args.repeats)]
        assert all(np.array_equal(s, o) for s, o in zip(sources, outputs, strict=True))
    finally:
        adapter.close()
        shutil.rmtree(root, ignore_errors=True)
    p_store, f_store, p_load, f_load = (statistics.median(col) for col in zip(*rounds, strict=True))

    def gbs(seconds: float) -> str:
        return f"{total / seconds / 1e9:6.2f} GB/s"

    rows = [
        ("plain write()", gbs(p_store)),
        ("fs adapter store", f"{gbs(f_store)} = {p_store / f_store:.2f}x plain"),
        ("plain readinto()", gbs(p_load)),
        ("fs adapter load", f"{gbs(f_load)} = {p_load / f_load:.2f}x plain"),
    ]
    report(
        f"fs adapter, {args.objects} x {args.object_mib} MiB",
        rows,
        {
            "objects": args.objects,
            "object_bytes": size,
            "plain_store_gbs": total / p_store / 1e9,
            "fs_store_gbs": total / f_store / 1e9,
            "plain_load_gbs": total / p_load / 1e9,
            "fs_load_gbs": total / f_load / 1e9,
            "store_ratio": p_store / f_store,
            "load_ratio": p_load / f_load,
        },
    )


if __name__ == "__main__":
    main()
