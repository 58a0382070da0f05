"""``kvtier selfcheck``: exercise the storage core end to end on embedded defaults.

Hashes two prompts that share a prefix, stores one chunk object per chunk,
looks the second prompt up, reads the hit chunks back and compares them bit
for bit with what was stored; a prompt under another tenant salt must miss.
Exits non-zero if anything differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtier.keys import Namespace, ObjectKey, TokenHasher, model_label
from kvtier.l1 import L1Config
from kvtier.layout import KVLayout
from kvtier.storage import StorageConfig, StorageManager
from kvtier.units import format_size


@dataclass(frozen=True, slots=True)
class SelfCheckReport:
    prompt_tokens: int
    shared_tokens: int
    chunk_size: int
    object_bytes: int
    stored_chunks: int
    hit_chunks: int
    expected_hit_chunks: int
    other_salt_hits: int
    bytes_identical: bool
    hash_s: float
    store_s: float
    lookup_s: float
    retrieve_s: float
    status: dict[str, object]

    @property
    def ok(self) -> bool:
        return (
            self.bytes_identical
            and self.hit_chunks == self.expected_hit_chunks
            and self.other_salt_hits == 0
        )


def run_selfcheck(
    l1_size: int = 256 << 20,
    prompt_tokens: int = 8192,
    shared_tokens: int = 6144 + 100,
    seed: int = 0,
) -> SelfCheckReport:
    layout = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16", tokens_per_chunk=256)
    namespace = Namespace(
        model="kvtier/selfcheck-tiny", kv_dtype=layout.dtype, layout=layout.digest()
    )
    hasher = TokenHasher(namespace, layout.tokens_per_chunk)
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 32000, prompt_tokens, dtype=np.uint32)
    second = first.copy()
    second[shared_tokens:] = rng.integers(0, 32000, prompt_tokens - shared_tokens, dtype=np.uint32)

    def keys_for(tokens: np.ndarray, ns: Namespace) -> list[ObjectKey]:
        hashes = TokenHasher(ns, layout.tokens_per_chunk).chunk_hashes(tokens)
        return [ObjectKey(h, model_label(ns.model), kv_rank=0, salt=ns.salt) for h in hashes]

    t0 = time.perf_counter()
    label = model_label(namespace.model)
    stored_keys = [ObjectKey(h, label, kv_rank=0) for h in hasher.chunk_hashes(first)]
    hash_s = time.perf_counter() - t0
    payloads = [rng.integers(0, 256, layout.object_bytes(), dtype=np.uint8) for _ in stored_keys]

    config = StorageConfig(l1=L1Config(size_bytes=l1_size))
    with StorageManager(config) as storage:
        t0 = time.perf_counter()
        storage.store(stored_keys, payloads)
        store_s = time.perf_counter() - t0

        lookup_keys = keys_for(second, namespace)
        t0 = time.perf_counter()
        hit = storage.lookup(lookup_keys)
        lookup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        views = storage.retrieve(lookup_keys[:hit])
        identical = all(np.array_equal(v, p) for v, p in zip(views, payloads, strict=False))
        retrieve_s = time.perf_counter() - t0
        del views
        storage.release(lookup_keys[:hit])

        other = keys_for(first, Namespace(**{**_fields(namespace), "salt": "other-tenant"}))
        other_hits = storage.lookup(other)
        storage.release(other[:other_hits])
        status = storage.status()

    return SelfCheckReport(
        prompt_tokens=prompt_tokens,
        shared_tokens=shared_tokens,
        chunk_size=layout.tokens_per_chunk,
        object_bytes=layout.object_bytes(),
        stored_chunks=len(stored_keys),
        hit_chunks=hit,
        expected_hit_chunks=shared_tokens // layout.tokens_per_chunk,
        other_salt_hits=other_hits,
        bytes_identical=identical and hit > 0,
        hash_s=hash_s,
        store_s=store_s,
        lookup_s=lookup_s,
        retrieve_s=retrieve_s,
        status=status,
    )


def _fields(namespace: Namespace) -> dict[str, str]:
    return {name: getattr(namespace, name) for name in Namespace.__dataclass_fields__}


def format_report(report: SelfCheckReport) -> str:
    moved = report.stored_chunks * report.object_bytes
    l1 = report.status["l1"]
    assert isinstance(l1, dict)
    rows = [
        ("prompt tokens / shared prefix", f"{report.prompt_tokens} / {report.shared_tokens}"),
        ("chunk size / object size", f"{report.chunk_size} / {format_size(report.object_bytes)}"),
        ("chunks stored", str(report.stored_chunks)),
        ("hit chunks (expected)", f"{report.hit_chunks} ({report.expected_hit_chunks})"),
        ("hits under another salt", str(report.other_salt_hits)),
        ("bytes identical", "yes" if report.bytes_identical else "NO"),
        ("hash", f"{report.hash_s * 1e3:.2f} ms"),
        ("store", f"{report.store_s * 1e3:.2f} ms ({moved / report.store_s / 1e9:.2f} GB/s)"),
        ("lookup", f"{report.lookup_s * 1e3:.3f} ms"),
        ("retrieve + compare", f"{report.retrieve_s * 1e3:.2f} ms"),
        ("L1 used", f"{format_size(l1['used_bytes'])} of {format_size(l1['capacity_bytes'])}"),
        ("locks held after release", str(report.status["held_lookup_locks"])),
        ("result", "OK" if report.ok else "FAILED"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
