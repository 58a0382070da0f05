"""Request traces: generated ones (``synthetic``), kvtier's trace files and
Mooncake's production traces (``mooncake``), all as ``TraceRequest``s."""

from kvtier.traces.files import is_mooncake_file, load_trace, read_trace, write_trace
from kvtier.traces.mooncake import (
    TRACE_BLOCK_TOKENS,
    MooncakeRecord,
    ReplaySpec,
    SkippedLines,
    read_mooncake,
    replay_requests,
)
from kvtier.traces.synthetic import (
    ChatSpec,
    RagSpec,
    Span,
    TraceRequest,
    chat_trace,
    rag_prompts,
    rag_trace,
)

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "ChatSpec",
    "MooncakeRecord",
    "RagSpec",
    "ReplaySpec",
    "SkippedLines",
    "Span",
    "TraceRequest",
    "chat_trace",
    "is_mooncake_file",
    "load_trace",
    "rag_prompts",
    "rag_trace",
    "read_mooncake",
    "read_trace",
    "replay_requests",
    "write_trace",
]
