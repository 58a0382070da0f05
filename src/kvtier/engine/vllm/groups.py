"""vLLM's KV-cache groups, as the connector keeps them.

With vLLM's hybrid KV-cache manager on (the connector supports it:
``SupportsHMA``), the layers of a model that attend differently get groups of
their own, each with its own block table: a request's block ids come as one
list per group. The groups' tensors overlay one allocation (a block id is
owned by one group at a time), so a layer's pages are only ever read or
written with its own group's block ids. A sliding-window group holds real
blocks only for the window: vLLM gives it the null block (id 0) for every
block before ``(H - W + 1) // block_size`` once ``H`` tokens are computed.

So a chunk's object keeps, for a sliding-window layer of window ``W``, only
the chunk's last ``ceil((W - 1) / block_size)`` blocks: what a hit ending at
that chunk's end (or any later one) can need, and what vLLM allocates real
blocks for when it loads one (``window_tokens``). The rest of a chunk's
sliding-window KV is never read again and is not stored
(``kvtier.layout.KVLayout.window_layers``).

Handled: full-attention groups (dense or MLA) and sliding-window groups of one
window size, all of one block size. Anything else (recurrent state, chunked
local attention, attention sinks, cross-attention, several window sizes) is
refused when the connector starts, naming the group's spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's placeholder block id: nothing of the request is there


@dataclass(frozen=True, slots=True)
class CacheGroups:
    """Which group each layer is in, and each group's sliding window (0: none)."""

    layer_groups: dict[str, int]
    windows: tuple[int, ...]
    block_size: int

    @classmethod
    def of(cls, kv_cache_config: Any, block_size: int) -> CacheGroups:
        """The groups of vLLM's ``KVCacheConfig``; ValueError naming what the
        connector does not handle. Without one (a test's stand-in), one group of
        full attention whose layers ``PagedKV`` finds in the registered tensors."""
        if kv_cache_config is None:
            return cls({}, (0,), block_size)
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )

        layer_groups: dict[str, int] = {}
        windows: list[int] = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            shape = f"group {index} ({type(spec).__name__}, layers {list(group.layer_names)})"
            if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
                windows.append(0)
            elif type(spec) is SlidingWindowSpec and not spec.extra_retained_tokens:
                windows.append(spec.sliding_window)
            else:
                raise ValueError(
                    f"the kvtier connector handles full-attention and sliding-window KV-cache "
                    f"groups, not {shape}"
                )
            if spec.block_size != block_size:
                raise ValueError(
                    f"the kvtier connector needs one block size; {shape} has {spec.block_size}, "
                    f"the engine {block_size}"
                )
            layer_groups.update(dict.fromkeys(group.layer_names, index))
        if len({w for w in windows if w}) > 1:
            raise ValueError(
                f"the kvtier connector handles one sliding-window size, not {sorted(set(windows))}"
            )
        return cls(layer_groups, tuple(windows), block_size)

    @property
    def window(self) -> int:
        """The sliding window of the model's windowed layers (0: none)."""
        return max(self.windows)

    def window_layers(self) -> int:
        return sum(1 for group in self.layer_groups.values() if self.windows[group])

    def window_tokens(self) -> int:
        """Tokens at the end of a chunk that a hit there needs of a window
        layer: whole blocks covering the ``W - 1`` before the next token."""
        if not self.window:
            return 0
        return -(-(self.window - 1) // self.block_size) * self.block_size


def block_lists(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """vLLM's block ids of a request, one list per group, as lists."""
    return [list(ids) for ids in block_ids]


__all__ = ["NULL_BLOCK", "CacheGroups", "block_lists"]
