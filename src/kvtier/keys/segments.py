"""Segment keys: the identity of a reusable piece of a prompt on its own.

A *segment* (a RAG document, a system prompt) is computed alone, at
positions ``0 .. n-1``, wherever it later appears; its KV is stored as
``ceil(n / C)`` pieces of ``C`` tokens (the last one padded), each an
ordinary object of the layout's size. Specification (version 1; golden
vectors in ``tests/unit/keys/test_segments.py``, prose in
``docs/hashing.md``)::

    root    = blake3(b"kvtier-seg-v1\\x00" + canonical_json(namespace)
                     + b"\\x00" + position_rule).digest()
    segment = blake3(root + LE32(n) + LE32(t_0) + ... + LE32(t_{n-1})).digest()
    piece_i = blake3(segment + LE32(i)).digest()

The domain string differs from the prefix chain's (``kvtier-ns-v1``), so a
segment's pieces and a prompt's chunks never share a key, even for the same
tokens at position 0. The namespace (model, revision, LoRA, KV dtype, layout
digest, tenant salt) and the position rule (how the stored K was rotated)
are both under the root: a segment never loads into another model, layout,
tenant or position convention.

A segment may also be computed *after an anchor* (the prompt's first
segment, ``kvtier.blend.BlendConfig.anchor``): its KV then depends on the
anchor's tokens too, and its K was rotated for positions ``A .. A+n-1`` (A:
the anchor's length). Such a segment's position rule names the anchor
(``SegmentHasher.after``)::

    rule = "after:" + hex(segment hash of the anchor under rope-from-0)

so it is found only after the same anchor, and never taken for a segment
computed alone or after another anchor. A segment computed ``g > 0``
positions past the anchor's end (positions ``A+g .. A+g+n-1``, nothing in
between: ``BlendConfig.at_offset``) has ``"+" + decimal(g)`` appended to
that rule, so each gap is its own object.
"""

from __future__ import annotations

import math

from blake3 import blake3

from kvtier.keys.hasher import ChunkHash, Tokens, token_array
from kvtier.keys.namespace import Namespace

SEGMENT_DOMAIN = b"kvtier-seg-v1\x00"
# K rotated by RoPE for positions 0..n-1 of the segment alone (kvtier.blend.rope).
ROPE_FROM_ZERO = "rope-from-0"
AFTER = "after:"  # + the anchor's segment hash: computed after that anchor (module docstring)


class SegmentHasher:
    """Piece hashes of segments for one namespace, position rule and piece size."""

    def __init__(
        self, namespace: Namespace, chunk_size: int, position_rule: str = ROPE_FROM_ZERO
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if not position_rule:
            raise ValueError("position_rule must name how the stored K was positioned")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.position_rule = position_rule
        self.root = blake3(
            SEGMENT_DOMAIN + namespace.canonical_json() + b"\x00" + position_rule.encode()
        ).digest()

    def piece_hashes(self, tokens: Tokens) -> list[ChunkHash]:
        """One 32-byte hash per piece of the segment, in order; ValueError for
        an empty segment."""
        segment = self.segment_hash(tokens)
        count = math.ceil(len(token_array(tokens)) / self.chunk_size)
        return [blake3(segment + i.to_bytes(4, "little")).digest() for i in range(count)]

    def segment_hash(self, tokens: Tokens) -> bytes:
        """The segment's own hash, which its pieces' derive from; ValueError
        for an empty segment."""
        data = token_array(tokens)
        if len(data) == 0:
            raise ValueError("a segment must hold at least one token")
        return (
            blake3(self.root)
            .update(len(data).to_bytes(4, "little"))
            .update(memoryview(data.data).cast("B"))
            .digest()
        )

    def after(self, anchor: Tokens, gap: int = 0) -> SegmentHasher:
        """The hasher of segments computed after ``anchor``, ``gap`` positions
        past its end (same namespace and piece size); see the module docstring."""
        if gap < 0:
            raise ValueError(f"a segment's gap after its anchor must be >= 0, got {gap}")
        alone = SegmentHasher(self.namespace, self.chunk_size)
        rule = AFTER + alone.segment_hash(anchor).hex() + (f"+{gap}" if gap else "")
        return SegmentHasher(self.namespace, self.chunk_size, rule)


__all__ = ["AFTER", "ROPE_FROM_ZERO", "SEGMENT_DOMAIN", "SegmentHasher"]
