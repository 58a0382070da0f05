"""The chunk-hash specification (kvtier.keys.hasher, docs/hashing.md)."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import Namespace, TokenHasher, root_hash, token_array

LLAMA = Namespace(model="meta-llama/Llama-3.1-8B", kv_dtype="bfloat16")
FULL = Namespace(
    model="m", revision="r1", lora="l", kv_dtype="float16", layout="abc", salt="tenant-7"
)

# Golden vectors: (namespace, tokens, chunk size) -> [root, h_0, h_1, ...].
GOLDEN = [
    (
        LLAMA,
        list(range(8)),
        4,
        [
            "645ccba4b3d6dee21bb3e822b038ec3b4b26fdb921404e14ca3b5c1b042321ee",
            "3a52d31b8e59cc78cf85b09c610120f5032562b39c0d94891facdfefe643fbe2",
            "dbd1aae6ddbe9ee83f4edca8645c89c32bccf5be46ca42106fbe953fe6877545",
        ],
    ),
    (
        FULL,
        [0, 1, 2**32 - 1, 7, 65536, 3],
        2,
        [
            "36bbd02c81dc3d9a5ef03d54169e7939b1a93f9bb88938e67153cb4b35e35f6b",
            "3faea1fc6216e4cb88fe2dc4552d96af9f2169b7374b81307e58c4e1c24fac32",
            "33415699270390b9958d519c85360269969d0b61ef34d05a4deba6a5cb2411fd",
            "0f66068aff8ab7e7b9196dc9850e42c6eaf5d01755a852aa7ceb68c28cc17edc",
        ],
    ),
]


def reference_chain(namespace: Namespace, tokens: list[int], chunk: int) -> list[bytes]:
    """The spec, written as literally as possible: root first, then one hash per full chunk."""
    fields = {f: getattr(namespace, f) for f in Namespace.__dataclass_fields__}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    parent = blake3(b"kvtier-ns-v1\x00" + canonical.encode("utf-8")).digest()
    chain = [parent]
    for i in range(len(tokens) // chunk):
        encoded = b"".join(struct.pack("<I", t) for t in tokens[i * chunk : (i + 1) * chunk])
        parent = blake3(parent + encoded).digest()
        chain.append(parent)
    return chain


@pytest.mark.parametrize(("namespace", "tokens", "chunk", "expected"), GOLDEN)
def test_golden_vectors(
    namespace: Namespace, tokens: list[int], chunk: int, expected: list[str]
) -> None:
    hasher = TokenHasher(namespace, chunk)
    assert hasher.root.hex() == expected[0]
    assert [h.hex() for h in hasher.chunk_hashes(tokens)] == expected[1:]
    assert [h.hex() for h in reference_chain(namespace, tokens, chunk)] == expected


def test_canonical_json_is_sorted_compact_utf8_with_all_fields() -> None:
    ns = Namespace(model="模型/x", salt="s")
    assert (
        ns.canonical_json()
        == (
            '{"kv_dtype":"","layout":"","lora":"","model":"模型/x","revision":"","salt":"s"}'
        ).encode()
    )


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    chunk=st.integers(1, 9),
)
def test_matches_reference_and_drops_partial_chunk(tokens: list[int], chunk: int) -> None:
    hashes = TokenHasher(FULL, chunk).chunk_hashes(tokens)
    assert hashes == reference_chain(FULL, tokens, chunk)[1:]
    assert len(hashes) == len(tokens) // chunk
    assert all(len(h) == 32 for h in hashes)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=48),
    data=st.data(),
)
def test_prefix_property(tokens: list[int], data: st.DataObject) -> None:
    chunk = 4
    k = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[k] = tokens[k] + 1
    hasher = TokenHasher(LLAMA, chunk)
    before, after = hasher.chunk_hashes(tokens), hasher.chunk_hashes(changed)
    first_changed = k // chunk
    assert before[:first_changed] == after[:first_changed]
    assert all(b != a for b, a in zip(before[first_changed:], after[first_changed:], strict=True))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
)
def test_stream_equals_whole_prompt(tokens: list[int], cuts: list[int]) -> None:
    hasher = TokenHasher(FULL, 5)
    stream = hasher.stream()
    produced: list[bytes] = []
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    for lo, hi in itertools.pairwise(bounds):
        produced += stream.extend(tokens[lo:hi])
    assert produced == stream.hashes == hasher.chunk_hashes(tokens)
    assert stream.num_tokens == len(tokens)


@pytest.mark.parametrize("field", ["model", "revision", "lora", "kv_dtype", "layout", "salt"])
def test_any_namespace_field_gives_disjoint_hashes(field: str) -> None:
    tokens = list(range(64))
    base = TokenHasher(FULL, 16).chunk_hashes(tokens)
    fields = {f: getattr(FULL, f) for f in Namespace.__dataclass_fields__}
    fields[field] += "-other"
    other = TokenHasher(Namespace(**fields), 16).chunk_hashes(tokens)
    assert root_hash(Namespace(**fields)) != root_hash(FULL)
    assert set(base).isdisjoint(other)


def test_chunk_size_changes_hashes() -> None:
    tokens = list(range(64))
    assert set(TokenHasher(FULL, 16).chunk_hashes(tokens)).isdisjoint(
        TokenHasher(FULL, 32).chunk_hashes(tokens)
    )


@pytest.mark.parametrize(
    "tokens",
    [
        list(range(20)),
        tuple(range(20)),
        np.arange(20, dtype=np.int64),
        np.arange(20, dtype=np.uint32),
        np.arange(20, dtype=np.uint16),
        np.arange(20, dtype=np.int32)[::1],
        np.arange(20, dtype=">u4"),
    ],
    ids=["list", "tuple", "int64", "uint32", "uint16", "int32", "big-endian"],
)
def test_accepts_sequences_and_arrays(tokens: object) -> None:
    expected = TokenHasher(LLAMA, 4).chunk_hashes(list(range(20)))
    assert TokenHasher(LLAMA, 4).chunk_hashes(tokens) == expected  # type: ignore[arg-type]


def test_uint32_array_is_hashed_without_a_copy() -> None:
    tokens = np.arange(1024, dtype=np.uint32)
    assert token_array(tokens) is tokens


def test_non_contiguous_array_hashes_like_its_copy() -> None:
    tokens = np.arange(40, dtype=np.int64)[::2]
    assert TokenHasher(LLAMA, 4).chunk_hashes(tokens) == TokenHasher(LLAMA, 4).chunk_hashes(
        tokens.copy()
    )


@pytest.mark.parametrize(
    ("tokens", "position"),
    [
        ([1, 2, -1, 4], 2),
        ([1, 2**32, 3], 1),
        (np.array([5, 6, 7, -9]), 3),
        ([1, 2.5, 3], 1),
        ([1, "7", 3], 1),
        ([1, 2, 2**70], 2),
        (np.array([1.0, 2.0]), 0),
    ],
)
def test_bad_tokens_name_their_position(tokens: object, position: int) -> None:
    with pytest.raises(ValueError, match=f"position {position}\\b"):
        TokenHasher(LLAMA, 2).chunk_hashes(tokens)  # type: ignore[arg-type]


def test_bad_shapes_and_chunk_sizes() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        TokenHasher(LLAMA, 2).chunk_hashes(np.zeros((2, 2), dtype=np.uint32))
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            TokenHasher(LLAMA, bad)  # type: ignore[arg-type]


def test_empty_and_short_prompts_have_no_hashes() -> None:
    assert TokenHasher(LLAMA, 4).chunk_hashes([]) == []
    assert TokenHasher(LLAMA, 4).chunk_hashes([1, 2, 3]) == []


_CHILD = """
import sys
from kvtier.keys import Namespace, TokenHasher
ns = Namespace(model="m", revision="r", salt="s")
print(",".join(h.hex() for h in TokenHasher(ns, 3).chunk_hashes(list(range(30)))))
"""


def test_same_hashes_in_processes_with_different_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    (line,) = outputs
    ns = Namespace(model="m", revision="r", salt="s")
    assert line.split(",") == [h.hex() for h in TokenHasher(ns, 3).chunk_hashes(list(range(30)))]


def test_a_tail_hash_names_the_partial_chunk_and_never_a_chain_hash() -> None:
    hasher = TokenHasher(FULL, 4)
    tokens = list(range(10))
    full = hasher.chunk_hashes(tokens)
    tail = hasher.tail_hash(tokens, full)
    assert tail is not None and tail not in full
    assert tail == blake3(b"kvtier-tail-v1\x00" + full[-1] + struct.pack("<2I", 8, 9)).digest()
    assert hasher.tail_hash(tokens[:8], full) is None  # no partial chunk
    assert hasher.tail_hash(tokens[:9], full) != tail  # other tokens, other tail
    short = hasher.tail_hash([7, 8], [])
    assert short == blake3(b"kvtier-tail-v1\x00" + hasher.root + struct.pack("<2I", 7, 8)).digest()
    # A tail is never the chain hash of a full chunk of the same tokens.
    assert TokenHasher(FULL, 2).chunk_hashes([7, 8]) != [short]
    with pytest.raises(ValueError, match="full chunks"):
        hasher.tail_hash(tokens, full[:1])
