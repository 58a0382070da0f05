"""Chunk hashing throughput for 32K-token prompts, single core.

Baseline in the same run: a chained ``hashlib.sha256`` over exactly the same
bytes (the parent digest followed by the chunk's little-endian uint32 tokens).

    python benchmarks/bench_hashing.py [--tokens 32768] [--chunk-size 256]
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

from common import median_time, report
from kvtier.keys import Namespace, TokenHasher


def sha256_chain(root: bytes, tokens: np.ndarray, chunk: int) -> list[bytes]:
    data = memoryview(tokens.data).cast("B")
    step = chunk * 4
    out, parent = [], root
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.sha256(parent)
        h.update(data[start : start + step])
        parent = h.digest()
        out.append(parent)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()

    hasher = TokenHasher(Namespace(model="bench/model", kv_dtype="bfloat16"), args.chunk_size)
    tokens = np.random.default_rng(0).integers(0, 150_000, args.tokens, dtype=np.uint32)
    as_list = tokens.tolist()
    as_int64 = tokens.astype(np.int64)
    n = args.tokens

    blake_med = median_time(lambda: hasher.chunk_hashes(tokens), args.repeats)
    i64_med = median_time(lambda: hasher.chunk_hashes(as_int64), args.repeats)
    list_med = median_time(lambda: hasher.chunk_hashes(as_list), args.repeats // 3)
    sha_med = median_time(lambda: sha256_chain(hasher.root, tokens, args.chunk_size), args.repeats)

    def mtok(seconds: float) -> str:
        return f"{n / seconds / 1e6:8.1f} M tokens/s ({seconds * 1e6:7.1f} us per prompt)"

    rows = [
        ("kvtier blake3, uint32 array", mtok(blake_med)),
        ("kvtier blake3, int64 array", mtok(i64_med)),
        ("kvtier blake3, Python list", mtok(list_med)),
        ("baseline chained sha256", mtok(sha_med)),
        ("ratio kvtier / sha256 (uint32)", f"{sha_med / blake_med:.2f}x"),
    ]
    report(
        f"hashing {n} tokens, chunk {args.chunk_size}",
        rows,
        {
            "tokens": n,
            "chunk_size": args.chunk_size,
            "blake3_uint32_mtok_s": n / blake_med / 1e6,
            "blake3_int64_mtok_s": n / i64_med / 1e6,
            "blake3_list_mtok_s": n / list_med / 1e6,
            "sha256_mtok_s": n / sha_med / 1e6,
            "ratio_vs_sha256": sha_med / blake_med,
        },
    )


if __name__ == "__main__":
    main()
