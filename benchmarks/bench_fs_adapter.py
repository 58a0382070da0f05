"""fs adapter store and load of N x 8 MiB objects, against plain Python file I/O.

Baseline in the same run, same directory, same bytes: for each object
``open(path, "wb").write(buffer)`` and ``open(path, "rb").readinto(buffer)``.
The adapter adds a header, an xxh3 checksum, a temp-file-and-rename publish,
and splits each batch over ``--io-threads`` threads (the baseline is one
thread; ``--io-threads 1`` compares like with like). Reads are page-cache
warm for both. Every store writes fresh files: the previous round's are
deleted and dirty pages are synced to disk before each timed store (untimed),
so neither side pays for the other's write-back.

    python benchmarks/bench_fs_adapter.py [--objects 64] [--object-mib 8] [--io-threads 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from common import object_options, objects_of, report, timed
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter


def main() -> None:
    parser = argparse.ArgumentParser()
    object_options(parser, objects=64, repeats=7)
    parser.add_argument("--io-threads", type=int, default=4, help="the adapter's io_threads")
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    args = parser.parse_args()

    size, sources = objects_of(args)
    total = args.objects * size
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.dir))
    outputs = [np.ones(size, dtype=np.uint8) for _ in range(args.objects)]
    keys = [ObjectKey(i.to_bytes(32, "big"), "bench", 0) for i in range(args.objects)]
    plain = root / "plain"
    completions = CompletionQueue()
    # Each round deletes the files behind the adapter's back and writes them
    # again: without skip_present, as the index still lists them.
    spec = {
        "type": "fs",
        "path": str(root / "fs"),
        "io_threads": args.io_threads,
        "skip_present": False,
    }
    adapter = make_adapter(spec, completions.put)

    def plain_store() -> float:
        shutil.rmtree(plain, ignore_errors=True)
        plain.mkdir()
        os.sync()

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
        os.sync()
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
    # Page-cache write-back makes single rounds noisy: compare within each round.
    store_ratios = sorted(p / f for p, f, _, _ in rounds)
    load_ratios = sorted(p / f for _, _, p, f in rounds)

    def gbs(seconds: float) -> str:
        return f"{total / seconds / 1e9:6.2f} GB/s"

    def spread(ratios: list[float]) -> str:
        return f"{statistics.median(ratios):.2f}x plain (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})"

    rows = [
        ("plain write()", gbs(p_store)),
        ("fs adapter store", f"{gbs(f_store)} = {spread(store_ratios)}"),
        ("plain readinto()", gbs(p_load)),
        ("fs adapter load", f"{gbs(f_load)} = {spread(load_ratios)}"),
    ]
    report(
        f"fs adapter ({args.io_threads} io threads), {args.objects} x {args.object_mib} MiB",
        rows,
        {
            "objects": args.objects,
            "object_bytes": size,
            "io_threads": args.io_threads,
            "plain_store_gbs": total / p_store / 1e9,
            "fs_store_gbs": total / f_store / 1e9,
            "plain_load_gbs": total / p_load / 1e9,
            "fs_load_gbs": total / f_load / 1e9,
            "store_ratio": statistics.median(store_ratios),
            "load_ratio": statistics.median(load_ratios),
        },
    )


if __name__ == "__main__":
    main()
