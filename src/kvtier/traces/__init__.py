"""Request traces: generated ones (``synthetic``), kvtier's trace files and
Mooncake's production traces (``mooncake``), all as ``TraceRequest``s; trace
files are read a bounded line at a time, plain or gzip (``lines``)."""

from kvtier.traces.files import is_mooncake_file, load_trace, read_trace, write_trace
from kvtier.traces.lines import DEFAULT_MAX_LINE_BYTES, MAX_LINE_FLAG
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
    "DEFAULT_MAX_LINE_BYTES",
    "MAX_LINE_FLAG",
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
