"""``kvtier selfcheck``: exercise the storage core end to end on embedded defaults.

1. Hash two 8K-token prompts that share a 6K-token prefix; store the first
   one's chunk objects in L1, with an fs L2 in a temporary directory behind it.
2. Look the second prompt up: the shared chunks hit in L1; read them back and
   compare bit for bit. A prompt under another tenant salt must miss.
3. Open a fresh storage stack (empty L1) on the same directory, as a restarted
   server would: the same lookup must now hit from the fs tier, bit for bit.

Exits non-zero if anything differs.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from kvtier.keys import Namespace, ObjectKey, TokenHasher, model_label
from kvtier.l1 import L1Config
from kvtier.layout import KVLayout
from kvtier.storage import StorageConfig, StorageManager
from kvtier.units import format_size

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16", tokens_per_chunk=256)


@dataclass(frozen=True, slots=True)
class SelfCheckReport:
    prompt_tokens: int
    shared_tokens: int
    object_bytes: int
    stored_chunks: int
    expected_hit_chunks: int
    l1_hit_chunks: int
    l2_hit_chunks: int
    l2_tier_objects: int
    other_salt_hits: int
    bytes_identical: bool
    store_s: float
    l1_lookup_s: float
    l2_lookup_s: float
    locks_left: int

    @property
    def ok(self) -> bool:
        expected = self.expected_hit_chunks
        return (
            self.bytes_identical
            and self.l1_hit_chunks == expected
            and self.l2_hit_chunks == expected
            and self.l2_tier_objects == expected
            and self.other_salt_hits == 0
            and self.locks_left == 0
        )


def _keys(tokens: npt.NDArray[np.uint32], namespace: Namespace) -> list[ObjectKey]:
    hashes = TokenHasher(namespace, LAYOUT.tokens_per_chunk).chunk_hashes(tokens)
    return [ObjectKey(h, model_label(namespace.model), 0, salt=namespace.salt) for h in hashes]


def _read_back(
    storage: StorageManager, keys: list[ObjectKey], payloads: list[npt.NDArray[np.uint8]]
) -> tuple[int, int, bool, float]:
    """Look keys up; return hit chunks, objects from L2, bytes identical, seconds."""
    start = time.perf_counter()
    result = storage.lookup(keys, LAYOUT)
    seconds = time.perf_counter() - start
    hit = keys[: result.hit_chunks]
    views = storage.retrieve(hit)
    same = all(np.array_equal(v, p) for v, p in zip(views, payloads, strict=False))
    del views
    storage.release(hit)
    from_l2 = sum(n for tier, n in result.objects_by_tier.items() if tier != "L1")
    return result.hit_chunks, from_l2, same and result.hit_chunks > 0, seconds


def run_selfcheck(
    l1_size: int = 256 << 20,
    prompt_tokens: int = 8192,
    shared_tokens: int = 6144 + 100,
    seed: int = 0,
) -> SelfCheckReport:
    namespace = Namespace(
        model="kvtier/selfcheck-tiny", kv_dtype=LAYOUT.dtype, layout=LAYOUT.digest()
    )
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 32000, prompt_tokens, dtype=np.uint32)
    second = first.copy()
    second[shared_tokens:] = rng.integers(0, 32000, prompt_tokens - shared_tokens, dtype=np.uint32)
    stored = _keys(first, namespace)
    payloads = [rng.integers(0, 256, LAYOUT.object_bytes(), dtype=np.uint8) for _ in stored]
    wanted = _keys(second, namespace)

    with tempfile.TemporaryDirectory(prefix="kvtier-selfcheck-") as cache_dir:
        config = StorageConfig(
            l1=L1Config(size_bytes=l1_size), l2=({"type": "fs", "path": cache_dir},)
        )
        with StorageManager(config) as storage:
            start = time.perf_counter()
            storage.store(stored, payloads, LAYOUT)
            store_s = time.perf_counter() - start
            storage.flush()  # the write-back to fs; done before timing lookups
            l1_hits, _, same_l1, l1_s = _read_back(storage, wanted, payloads)
            other = _keys(first, replace(namespace, salt="other-tenant"))
            other_hits = storage.lookup(other, LAYOUT).hit_chunks
            storage.release(other[:other_hits])
        with StorageManager(config) as restarted:
            l2_hits, from_l2, same_l2, l2_s = _read_back(restarted, wanted, payloads)
            locks_left = restarted.held_locks()

    return SelfCheckReport(
        prompt_tokens=prompt_tokens,
        shared_tokens=shared_tokens,
        object_bytes=LAYOUT.object_bytes(),
        stored_chunks=len(stored),
        expected_hit_chunks=shared_tokens // LAYOUT.tokens_per_chunk,
        l1_hit_chunks=l1_hits,
        l2_hit_chunks=l2_hits,
        l2_tier_objects=from_l2,
        other_salt_hits=other_hits,
        bytes_identical=same_l1 and same_l2,
        store_s=store_s,
        l1_lookup_s=l1_s,
        l2_lookup_s=l2_s,
        locks_left=locks_left,
    )


def format_report(report: SelfCheckReport) -> str:
    moved = report.stored_chunks * report.object_bytes
    expected = report.expected_hit_chunks
    rows = [
        ("prompt tokens / shared prefix", f"{report.prompt_tokens} / {report.shared_tokens}"),
        ("chunk objects stored", f"{report.stored_chunks} x {format_size(report.object_bytes)}"),
        ("L1 hit chunks (expected)", f"{report.l1_hit_chunks} ({expected})"),
        ("after restart, hits from fs", f"{report.l2_hit_chunks} ({expected})"),
        ("hits under another salt", str(report.other_salt_hits)),
        ("bytes identical", "yes" if report.bytes_identical else "NO"),
        (
            "store into L1",
            f"{report.store_s * 1e3:.2f} ms ({moved / report.store_s / 1e9:.2f} GB/s)",
        ),
        ("lookup, L1 hit", f"{report.l1_lookup_s * 1e3:.3f} ms"),
        ("lookup, load from fs", f"{report.l2_lookup_s * 1e3:.2f} ms"),
        ("locks held after release", str(report.locks_left)),
        ("result", "OK" if report.ok else "FAILED"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
