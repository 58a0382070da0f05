"""``PrefixPins``: the scheduler side's pins of listed prompt prefixes.

With ``kvtier.pin_prefixes_file`` (a JSON list of token-id lists, e.g.
system prompts), a request whose prompt starts with a listed prefix renews
that prefix's pin in the server's L1 once its lookup shows the prefix's
chunks in kvtier, at most every half ``pin_ttl_s`` per (salt, prefix), sent
without waiting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kvtier.protocol.client import CacheClient


class PrefixPins:
    """See the module docstring."""

    def __init__(self, prefixes: Sequence[tuple[int, ...]], ttl_s: float) -> None:
        self.prefixes = list(prefixes)
        self.ttl_s = ttl_s
        self._sent: dict[tuple[str, int], float] = {}  # (salt, prefix) -> last pin sent

    def listed_prefix(self, prompt: list[int], chunk_size: int) -> tuple[int, int] | None:
        """The longest listed prefix ``prompt`` starts with: (its index, its
        full chunks), or None."""
        best = None
        for index, prefix in enumerate(self.prefixes):
            chunks = len(prefix) // chunk_size if chunk_size else 0
            matches = chunks and tuple(prompt[: len(prefix)]) == prefix
            if matches and (best is None or chunks > best[1]):
                best = (index, chunks)
        return best

    def renew(
        self,
        client: CacheClient,
        salt: str,
        listed: tuple[int, int],
        hashes: list[bytes],
        hit: int,
    ) -> None:
        """Renew the pin of prefix ``listed`` (``listed_prefix``'s answer) if
        the lookup's ``hit`` covers it and its last pin is half a TTL old."""
        index, chunks = listed
        if hit < chunks:
            return
        now, key = time.monotonic(), (salt, index)
        if now - self._sent.get(key, -math.inf) >= self.ttl_s / 2:
            self._sent[key] = now
            client.pin(hashes[:chunks], self.ttl_s, wait=False)


__all__ = ["PrefixPins"]
