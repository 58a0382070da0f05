"""A multi-tenant trace for the routing benchmark (``tenant_trace``).

Each tenant has its own system prompt, its own pool of RAG documents
(Zipf popularity) and its own chat sessions. Requests arrive as a Poisson
stream at ``rate`` per second; each belongs to a tenant chosen uniformly and
is, with probability ``chat_share``, the next turn of one of that tenant's
sessions (the session's previous prompt, a stand-in answer and a new user
message), else a RAG question (the system prompt, 1-2 of the tenant's
documents, a question). Every tenant's prompts start with its own system
prompt, so a router that keeps a tenant on the nodes holding its prefixes
wins, and the tenants together need more KV than one node's L1 holds.

Pure: the same spec, the same trace. ``TraceRequest.tenant`` names the
tenant (the benchmark sends its API key).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.traces import Span, TraceRequest


@dataclass(frozen=True, slots=True)
class TenancySpec:
    tenants: int = 4
    requests: int = 80
    rate: float = 2.0  # arrivals per second
    seed: int = 0
    vocab_size: int = 4096
    system_tokens: int = 384
    documents: int = 6  # per tenant
    doc_tokens: Span = (512, 768)
    docs_per_request: Span = (1, 2)
    zipf: float = 1.1
    chat_share: float = 0.4
    sessions: int = 2  # per tenant
    user_tokens: Span = (32, 96)
    question_tokens: Span = (24, 64)
    output_tokens: Span = (8, 16)

    def __post_init__(self) -> None:
        for name in ("tenants", "requests", "documents", "sessions", "system_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.rate <= 0:
            raise ValueError(f"--rate must be positive, got {self.rate}")
        if not 0 <= self.chat_share <= 1:
            raise ValueError(f"--chat-share must be in [0, 1], got {self.chat_share}")


def tenant_name(index: int) -> str:
    return f"tenant{index}"


def tenant_trace(spec: TenancySpec) -> list[TraceRequest]:
    rng = np.random.default_rng(spec.seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, spec.vocab_size, n)]

    def length(span: Span) -> int:
        return int(rng.integers(span[0], span[1] + 1))

    systems = [tokens(spec.system_tokens) for _ in range(spec.tenants)]
    documents = [
        [tokens(length(spec.doc_tokens)) for _ in range(spec.documents)]
        for _ in range(spec.tenants)
    ]
    sessions = [[list(systems[t]) for _ in range(spec.sessions)] for t in range(spec.tenants)]
    turns = [[0] * spec.sessions for _ in range(spec.tenants)]
    popularity = 1.0 / np.arange(1, spec.documents + 1) ** spec.zipf
    popularity /= popularity.sum()
    arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, spec.requests))
    trace = []
    for i, at in enumerate(arrivals):
        tenant = int(rng.integers(0, spec.tenants))
        output = length(spec.output_tokens)
        if rng.random() < spec.chat_share:
            s = int(rng.integers(0, spec.sessions))
            history = sessions[tenant][s]
            history += tokens(length(spec.user_tokens))
            prompt = tuple(history)
            label = f"{tenant_name(tenant)} chat {s} turn {turns[tenant][s]}"
            turns[tenant][s] += 1
            history += tokens(output)  # the stand-in answer the next turn builds on
        else:
            count = min(spec.documents, length(spec.docs_per_request))
            chosen = rng.choice(spec.documents, count, False, popularity)
            body = [t for d in chosen for t in documents[tenant][int(d)]]
            prompt = tuple(systems[tenant] + body + tokens(length(spec.question_tokens)))
            label = f"{tenant_name(tenant)} docs " + "+".join(str(int(d)) for d in chosen)
        trace.append(
            TraceRequest(
                f"req-{i:04d}", float(at), prompt, output, label, tenant=tenant_name(tenant)
            )
        )
    return trace


__all__ = ["TenancySpec", "tenant_name", "tenant_trace"]
