"""Chunk-size negotiation between the server and engines.

The configured chunk size is a minimum. The first engine's block alignment
fixes the chunk size to the smallest multiple of that alignment that is at
least the configured size; from then on it is frozen (every stored object
depends on it), and an engine whose alignment does not divide it is refused
with an error naming the sizes.
"""

from __future__ import annotations


def round_up(minimum: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``minimum``.

    >>> round_up(256, 640), round_up(1024, 544), round_up(256, 32)
    (640, 1088, 256)
    """
    if minimum <= 0 or alignment <= 0:
        raise ValueError(
            f"chunk size and block alignment must be positive, got {minimum} and {alignment}"
        )
    return -(-minimum // alignment) * alignment


class ChunkSizeNegotiator:
    """Holds the configured minimum and, once an engine registered, the frozen size."""

    def __init__(self, minimum: int) -> None:
        round_up(minimum, 1)  # validates
        self.minimum = minimum
        self.frozen: int | None = None

    def propose(self, alignment: int) -> int:
        """The chunk size for an engine with this block alignment, without
        freezing it (ValueError if it cannot use the frozen one)."""
        if self.frozen is None:
            return round_up(self.minimum, alignment)
        if alignment <= 0 or self.frozen % alignment:
            raise ValueError(
                f"block alignment {alignment} does not divide the chunk size {self.frozen} "
                "already in use; restart the server with --chunk-size set to a common "
                "multiple of your engines' block sizes"
            )
        return self.frozen

    def freeze(self, chunk_size: int) -> None:
        """Fix the chunk size once the first engine is registered."""
        if self.frozen is None:
            self.frozen = chunk_size
