"""L2: the adapter contract, the stored-object format and the adapters."""

from kvtier.l2.base import (
    AdapterConfig,
    CompletionQueue,
    L2Adapter,
    TaskId,
    TaskKind,
    TaskResult,
)
from kvtier.l2.blocking import BackendUnavailable, BlockingAdapter
from kvtier.l2.registry import ADAPTER_TYPES, adapter_class, make_adapter

__all__ = [
    "ADAPTER_TYPES",
    "AdapterConfig",
    "BackendUnavailable",
    "BlockingAdapter",
    "CompletionQueue",
    "L2Adapter",
    "TaskId",
    "TaskKind",
    "TaskResult",
    "adapter_class",
    "make_adapter",
]
