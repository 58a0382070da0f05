"""L1 put and get of 8 MiB objects through ``StorageManager``, against memcpy.

put: ``store()`` = reserve_write + fence + copy in from a numpy array + finish_write.
get: ``lookup()`` + ``retrieve()`` + copy out to a numpy array + ``release()``.
Baseline in the same run: ``numpy.copyto`` of the same bytes between two
pre-faulted numpy arrays. The arena is pre-faulted (``populate``) as in
production.

    python benchmarks/bench_l1_copy.py [--objects 32] [--object-mib 8]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import median_time, object_options, objects_of, report, timed
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager


def main() -> None:
    parser = argparse.ArgumentParser()
    object_options(parser, objects=32, repeats=15)
    args = parser.parse_args()

    size, sources = objects_of(args)
    total = args.objects * size
    outputs = [np.ones(size, dtype=np.uint8) for _ in range(args.objects)]  # pre-faulted
    keys = [ObjectKey(i.to_bytes(32, "big"), "bench", 0) for i in range(args.objects)]

    def memcpy() -> None:
        for src, dst in zip(sources, outputs, strict=True):
            np.copyto(dst, src)

    config = StorageConfig(l1=L1Config(size_bytes=2 * total, high_watermark=0.9))
    with StorageManager(config) as storage:
        assert storage.wait_mapped(120)  # as a server would be a few seconds after start

        def put() -> float:
            storage.clear_l1()  # untimed: every put stores new objects
            return timed(lambda: storage.store(keys, sources))

        def get() -> None:
            assert storage.lookup(keys).hit_chunks == len(keys)
            for view, dst in zip(storage.retrieve(keys), outputs, strict=True):
                np.copyto(dst, view)
            storage.release(keys)

        memcpy()
        put()  # warm-up
        base = median_time(memcpy, args.repeats)
        put_med = statistics.median(put() for _ in range(args.repeats))
        get_med = median_time(get, args.repeats)
        assert all(np.array_equal(s, o) for s, o in zip(sources, outputs, strict=True))

    def gbs(seconds: float) -> str:
        return f"{total / seconds / 1e9:6.2f} GB/s"

    rows = [
        ("numpy.copyto baseline", gbs(base)),
        ("L1 put (store)", f"{gbs(put_med)} = {base / put_med:.2f}x memcpy"),
        (
            "L1 get (lookup, retrieve, copy, release)",
            f"{gbs(get_med)}  = {base / get_med:.2f}x memcpy",
        ),
    ]
    report(
        f"L1 put/get, {args.objects} x {args.object_mib} MiB",
        rows,
        {
            "objects": args.objects,
            "object_bytes": size,
            "memcpy_gbs": total / base / 1e9,
            "put_gbs": total / put_med / 1e9,
            "get_gbs": total / get_med / 1e9,
            "put_ratio": base / put_med,
            "get_ratio": base / get_med,
        },
    )


if __name__ == "__main__":
    main()
