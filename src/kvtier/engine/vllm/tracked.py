"""``Tracked``: one request as the connector's scheduler side follows it,
and the block arithmetic of what it loads, stores and shadow-checks.

A request's prompt is cut into chunks of ``chunk_size`` tokens, each
``chunk_size // block_size`` of vLLM's blocks; ``block_ids`` are the
request's blocks in prompt order, one list per KV-cache group
(``kvtier.engine.vllm.groups``; a sliding-window group's blocks before its
window are the null block, which a load skips). Chunks ``[0, stored)`` are in kvtier (its
hit, or stored by this engine); a step that completes more prompt chunks
stores them (``stores``); the chunk chosen for the shadow check is compared
once computed (``shadows``); a hit is loaded into the blocks of the tokens
vLLM did not have (``load_spec``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.vllm.groups import NULL_BLOCK
from kvtier.engine.vllm.handoff import Consume, Produce
from kvtier.engine.vllm.metadata import BlendSpec, LoadSpec, ShadowSpec, StoreSpec
from kvtier.protocol.client import CacheClient, LookupState


@dataclass(slots=True)
class Tracked:
    request_id: str
    salt: str
    client: CacheClient | None
    chunk_size: int
    hashes: list[bytes]  # of the prompt's full chunks
    prompt_tokens: int
    preemptions: int
    lookup: LookupState | None = None
    settled: bool = False  # the lookup's outcome was counted (and a shadow chunk chosen)
    shadow_chunk: int | None = None  # the hit chunk vLLM computes for the shadow check
    local: int = 0  # tokens the engine had itself when last asked
    stored: int = 0  # chunks [0, stored) are in kvtier (hit, or stored by us)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    received: bool = False  # an asynchronous load of its hit has come back
    pin: tuple[int, int] | None = None  # a listed prefix it starts with: (index, chunks)
    role: Produce | Consume | None = None  # its part in a prefill/decode hand-off
    load_blocks: set[int] = field(default_factory=set)  # the blocks its loads fill
    loaded: bool = False  # a consumer's hand-off load came back whole
    blend: BlendSpec | None = None  # a blend it asked for (block ids once allocated)
    saves_after_step: bool = False  # a store of it left the step: vLLM must keep its blocks

    def blocks(self) -> int:
        """The blocks vLLM holds for it (every group holds as many, nulls included)."""
        return len(self.block_ids[0]) if self.block_ids else 0

    def load_spec(
        self, blocks: Any, num_external_tokens: int, block_size: int, asynchronous: bool
    ) -> LoadSpec:
        """Load the chunks that tokens [local, local + num_external_tokens)
        fall in, into their blocks (``blocks``: vLLM's allocation; a chunk's
        blocks outside that range are the engine's own, or past the prompt)."""
        per_chunk = self.chunk_size // block_size
        first_block = self.local // block_size
        end_block = -(-(self.local + num_external_tokens) // block_size)
        first, end = first_block // per_chunk, -(-end_block // per_chunk)
        groups = blocks.get_block_ids()
        spec = LoadSpec(
            self.request_id,
            self.salt,
            first,
            self.hashes[first:end],
            [
                [
                    {
                        j: ids[chunk * per_chunk + j]
                        for j in range(per_chunk)
                        if first_block <= chunk * per_chunk + j < end_block
                        and ids[chunk * per_chunk + j] != NULL_BLOCK
                    }
                    for ids in groups
                ]
                for chunk in range(first, end)
            ],
            asynchronous=asynchronous,
        )
        self.load_blocks = set(spec.block_ids())
        return spec

    def failed_load(
        self, blocks: Any, num_external_tokens: int, block_size: int, asynchronous: bool
    ) -> LoadSpec:
        """A load whose every block is a load error (no chunk is read)."""
        first = self.local // block_size
        end = -(-(self.local + num_external_tokens) // block_size)
        mapping = [
            {j: b for j, b in enumerate(ids[first:end]) if b != NULL_BLOCK}
            for ids in blocks.get_block_ids()
        ]
        return LoadSpec(self.request_id, self.salt, 0, [], [mapping], asynchronous, True)

    def stores(
        self, done_tokens: int, block_size: int, store_all: bool, save_async: bool
    ) -> list[StoreSpec]:
        """Prompt chunks this step completes that kvtier does not have yet
        (only a producer's unless ``store_all``; a producer's tail too; a
        consumer's never: they came from kvtier); after the step if
        ``save_async``, except a producer's (offered as it finishes)."""
        role = self.role
        skip = not store_all and not isinstance(role, Produce)
        if skip or isinstance(role, Consume) or self.client is None or not self.chunk_size:
            return []
        per_chunk = self.chunk_size // block_size
        complete = min(done_tokens, self.prompt_tokens) // self.chunk_size
        complete = min(complete, len(self.hashes), self.blocks() // per_chunk)
        specs = []
        if complete > self.stored:
            specs.append(
                StoreSpec(
                    self.request_id,
                    self.salt,
                    self.hashes[self.stored : complete],
                    [ids[self.stored * per_chunk : complete * per_chunk] for ids in self.block_ids],
                    in_step=isinstance(role, Produce) or not save_async,
                )
            )
            self.stored = complete
            self.saves_after_step |= not specs[0].in_step
        if isinstance(role, Produce) and role.tail is not None and not role.tail_stored:
            specs += self._tail_store(role, done_tokens, block_size)
        return specs

    def _tail_store(self, role: Produce, done_tokens: int, block_size: int) -> list[StoreSpec]:
        """A producer's prompt tail, once computed: its blocks, the last one
        repeated to fill the object (those pages are past the prompt and never
        loaded: a consumer's load stops at its last token's block)."""
        assert role.tail is not None
        per_chunk = self.chunk_size // block_size
        full = len(self.hashes) * per_chunk
        tail_blocks = -(-self.prompt_tokens // block_size) - full
        if done_tokens < self.prompt_tokens or self.blocks() < full + tail_blocks:
            return []
        role.tail_stored = True
        blocks = [ids[full : full + tail_blocks] for ids in self.block_ids]
        blocks = [ids + [ids[-1]] * (per_chunk - len(ids)) for ids in blocks]
        return [StoreSpec(self.request_id, self.salt, [role.tail], blocks, in_step=True)]

    def shadows(self, done_tokens: int, block_size: int) -> list[ShadowSpec]:
        """The shadow check of the request's chunk that this step computed, if it did."""
        chunk = self.shadow_chunk
        if chunk is None or self.client is None:
            return []
        per_chunk = self.chunk_size // block_size
        end = (chunk + 1) * per_chunk
        if done_tokens < (chunk + 1) * self.chunk_size or self.blocks() < end:
            return []
        self.shadow_chunk = None
        blocks = [ids[chunk * per_chunk : end] for ids in self.block_ids]
        return [ShadowSpec(self.request_id, self.salt, chunk, self.hashes[chunk], blocks)]


__all__ = ["Tracked"]
