"""What the scheduler side tells the workers each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.blend import BlendConfig


@dataclass(slots=True)
class LoadSpec:
    """Copy chunks ``hashes`` of a request into engine blocks: before its
    forward, or, ``asynchronous``, on the worker's load thread while the
    request waits for remote KV (done when ``get_finished`` names it).
    ``blocks[i][g]`` maps a block's position within chunk ``i`` to the engine
    block of KV-cache group ``g`` it goes to (a chunk's leading blocks may be
    the engine's own; a sliding-window group's blocks before its window are
    not loaded)."""

    request_id: str
    salt: str
    first_chunk: int  # the prompt chunk ``hashes[0]`` is
    hashes: list[bytes]
    blocks: list[list[dict[int, int]]]
    asynchronous: bool = False
    failed: bool = False  # a hand-off that did not come, under the error policy: fail every block

    def block_ids(self, start: int = 0) -> list[int]:
        """The engine blocks of chunks ``[start, ...)``, every group's."""
        return [b for chunk in self.blocks[start:] for group in chunk for b in group.values()]

    def filled_blocks(self, chunks: int) -> int:
        """Blocks the first ``chunks`` fill, counted in the group that fills most."""
        return sum(max(len(group) for group in chunk) for chunk in self.blocks[:chunks])


@dataclass(slots=True)
class StoreSpec:
    """Store chunks ``hashes`` of a request, computed by this step's forward,
    from ``block_ids`` (``blocks_per_chunk`` per chunk, in order): after the
    step, on the worker's save thread (vLLM keeps the request's blocks until
    every rank reports its saves done), or ``in_step``, before the step
    returns (a prefill engine's hand-off, offered as the request finishes).
    One list of block ids per KV-cache group."""

    request_id: str
    salt: str
    hashes: list[bytes]
    block_ids: list[list[int]]
    in_step: bool = False


@dataclass(slots=True)
class ShadowSpec:
    """Compare chunk ``chunk`` of a request, which this step's forward computed
    into ``block_ids`` (per KV-cache group) instead of loading it, with
    kvtier's copy (``hash``)."""

    request_id: str
    salt: str
    chunk: int
    hash: bytes
    block_ids: list[list[int]]


@dataclass(slots=True)
class BlendSpec:
    """Blend a request's whole prompt ``tokens`` from its ``spans`` before
    the forward, and write the K and V of every token but the last
    (``written``) into ``block_ids``; vLLM computes the last one
    (``kvtier.engine.vllm.blending``)."""

    request_id: str
    salt: str
    tokens: list[int]
    spans: list[tuple[int, int]]
    config: BlendConfig
    block_ids: list[int]

    @property
    def written(self) -> int:
        """The tokens whose K and V the blend writes (and vLLM is offered)."""
        return len(self.tokens) - 1


@dataclass(slots=True)
class KVTierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    shadows: list[ShadowSpec] = field(default_factory=list)
    blends: list[BlendSpec] = field(default_factory=list)
    computed_tokens: int = 0  # tokens this step's forward computes, every request together
    preempted: list[str] = field(default_factory=list)  # requests whose blocks vLLM freed
