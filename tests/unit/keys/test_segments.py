"""Segment keys (docs/hashing.md "Segment keys"): golden vectors, one piece
per ``C`` tokens, and a key domain apart from prefix chunks, namespaces and
position rules."""

from __future__ import annotations

import pytest
from blake3 import blake3

from kvtier.keys import Namespace, SegmentHasher, TokenHasher
from kvtier.keys.segments import AFTER, SEGMENT_DOMAIN

NS = Namespace(model="m", revision="r", kv_dtype="bfloat16", layout="abc", salt="s")


def test_golden_vectors() -> None:
    hasher = SegmentHasher(NS, 4)
    root = blake3(SEGMENT_DOMAIN + NS.canonical_json() + b"\x00rope-from-0").digest()
    tokens = [1, 2, 3, 4, 5, 70000]
    segment = blake3(
        root + (6).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    ).digest()
    expected = [blake3(segment + i.to_bytes(4, "little")).digest() for i in range(2)]
    assert hasher.piece_hashes(tokens) == expected
    assert [h.hex()[:16] for h in expected] == ["f030282fcc76392c", "b32343d4a35993f6"]


def test_golden_vectors_after_an_anchor() -> None:
    anchor, tokens = [7, 8, 9], [1, 2, 3, 4, 5, 70000]
    alone = SegmentHasher(NS, 4)
    rule = AFTER + alone.segment_hash(anchor).hex()
    root = blake3(SEGMENT_DOMAIN + NS.canonical_json() + b"\x00" + rule.encode()).digest()
    segment = blake3(
        root + (6).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    ).digest()
    expected = [blake3(segment + i.to_bytes(4, "little")).digest() for i in range(2)]
    after = alone.after(anchor)
    assert after.position_rule == rule and after.piece_hashes(tokens) == expected
    assert [h.hex()[:16] for h in expected] == ["fcc91573bcf77be6", "872a61d07be43fce"]
    # the same tokens alone, or after another anchor, are other objects
    assert not set(expected) & set(alone.piece_hashes(tokens))
    assert not set(expected) & set(alone.after([7, 8]).piece_hashes(tokens))
    with pytest.raises(ValueError, match="at least one token"):
        alone.after([])
    # a gap past the anchor's end is in the rule: each gap its own object
    gapped = alone.after(anchor, 512)
    assert gapped.position_rule == rule + "+512"
    assert alone.after(anchor, 0).position_rule == rule
    assert not set(expected) & set(gapped.piece_hashes(tokens))
    assert not set(gapped.piece_hashes(tokens)) & set(alone.after(anchor, 256).piece_hashes(tokens))
    with pytest.raises(ValueError, match="gap after its anchor must be >= 0"):
        alone.after(anchor, -1)


@pytest.mark.parametrize(("tokens", "pieces"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_one_piece_per_chunk_size_tokens(tokens: int, pieces: int) -> None:
    assert len(SegmentHasher(NS, 4).piece_hashes(list(range(tokens)))) == pieces


def test_segments_never_share_keys_with_prefix_chunks_or_other_domains() -> None:
    tokens = list(range(16))
    pieces = SegmentHasher(NS, 4).piece_hashes(tokens)
    assert not set(pieces) & set(TokenHasher(NS, 4).chunk_hashes(tokens))
    for other in (
        SegmentHasher(Namespace(model="m", revision="r", kv_dtype="bfloat16", layout="abc"), 4),
        SegmentHasher(
            Namespace(model="m2", revision="r", kv_dtype="bfloat16", layout="abc", salt="s"), 4
        ),
        SegmentHasher(NS, 4, position_rule="unrotated"),
    ):
        assert not set(pieces) & set(other.piece_hashes(tokens))
    # the length is in the hash: a segment is not a prefix of a longer one
    assert SegmentHasher(NS, 4).piece_hashes(tokens[:8])[0] != pieces[0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        SegmentHasher(NS, 0)
    with pytest.raises(ValueError, match="position_rule"):
        SegmentHasher(NS, 4, position_rule="")
    with pytest.raises(ValueError, match="at least one token"):
        SegmentHasher(NS, 4).piece_hashes([])
    with pytest.raises(ValueError, match="position 1"):
        SegmentHasher(NS, 4).piece_hashes([1, -2])
