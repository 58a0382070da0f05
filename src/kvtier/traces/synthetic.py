"""Request traces: what a benchmark sends, and when.

Two generators, each a pure function of its spec (the same ``seed``, the same
trace):

- ``rag_trace``: one shared system prompt, a pool of documents
  picked with Zipf popularity, questions that put 1-3 of them after the system
  prompt, Poisson arrivals at ``rate`` per second, output lengths drawn
  uniformly from a range. With ``prime`` (the default) the trace starts with
  one warm request per document (the system prompt and that document): the
  documents are hot, as popular documents are in a service that has been
  running, while each question and each combination of documents
  after the first is still new.
- ``chat_trace``: sessions arriving at ``rate`` per second; each turn's prompt
  is the previous prompt, the previous answer and a new user message, sent
  after an exponential think time. The answer a trace appends is a stand-in of
  the requested length (a trace is fixed before any model runs), so the next
  turn shares the previous prompt, not the model's own answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Span = tuple[int, int]  # MIN, MAX (inclusive)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    arrival_s: float  # seconds after the trace starts
    prompt: tuple[int, ...]  # token ids
    output_tokens: int  # tokens to generate (sent with ignore_eos)
    label: str = ""  # what it is made of, for people
    warm: bool = False  # sent before the measured replay, one at a time, not measured
    tenant: str = ""  # whose request it is ("" the default tenant)


def _check_span(flag: str, span: Span, least: int = 1) -> None:
    low, high = span
    if not least <= low <= high:
        raise ValueError(f"{flag} must be MIN:MAX with {least} <= MIN <= MAX, got {low}:{high}")


def _check_at_least(flag: str, value: float, least: float) -> None:
    if not value >= least:
        raise ValueError(f"{flag} must be at least {least:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class RagSpec:
    requests: int = 48
    rate: float = 1.0  # arrivals per second (Poisson); 0: all at once
    seed: int = 0
    vocab_size: int = 4096
    system_tokens: int = 200
    documents: int = 10
    doc_tokens: Span = (768, 1280)
    docs_per_request: Span = (1, 3)
    zipf: float = 1.1  # document popularity ~ 1 / rank^zipf
    question_tokens: Span = (24, 64)
    output_tokens: Span = (16, 48)
    prime: bool = True  # one warm request per document first

    def __post_init__(self) -> None:
        for flag, value in (
            ("--requests", self.requests),
            ("--system-tokens", self.system_tokens),
            ("--documents", self.documents),
            ("--vocab-size", self.vocab_size),
        ):
            _check_at_least(flag, value, 1)
        _check_at_least("--rate", self.rate, 0)
        _check_at_least("--zipf", self.zipf, 0)
        for flag, span in (
            ("--doc-tokens", self.doc_tokens),
            ("--docs-per-request", self.docs_per_request),
            ("--question-tokens", self.question_tokens),
            ("--output-tokens", self.output_tokens),
        ):
            _check_span(flag, span)


@dataclass(frozen=True, slots=True)
class ChatSpec:
    sessions: int = 8
    turns: Span = (3, 6)
    rate: float = 0.4  # new sessions per second (Poisson)
    think_s: float = 4.0  # mean seconds between a session's turns (exponential)
    seed: int = 0
    vocab_size: int = 4096
    system_tokens: int = 200
    user_tokens: Span = (32, 160)
    output_tokens: Span = (16, 48)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--sessions", self.sessions),
            ("--system-tokens", self.system_tokens),
            ("--vocab-size", self.vocab_size),
        ):
            _check_at_least(flag, value, 1)
        _check_at_least("--rate", self.rate, 0)
        _check_at_least("--think-s", self.think_s, 0)
        for flag, span in (
            ("--turns", self.turns),
            ("--user-tokens", self.user_tokens),
            ("--output-tokens", self.output_tokens),
        ):
            _check_span(flag, span)


class _Draw:
    """Token ids and lengths from one generator, in a fixed order."""

    def __init__(self, rng: np.random.Generator, vocab_size: int) -> None:
        self.rng = rng
        self.vocab_size = vocab_size

    def length(self, span: Span) -> int:
        return int(self.rng.integers(span[0], span[1] + 1))

    def tokens(self, span: Span) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab_size, self.length(span))]


def _arrivals(rng: np.random.Generator, count: int, rate: float) -> list[float]:
    if rate == 0:
        return [0.0] * count
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, count))]


def rag_prompts(spec: RagSpec) -> list[tuple[list[int], tuple[int, ...]]]:
    """Each request's prompt and the documents in it, in prompt order."""
    return _rag(spec)[2]


def _rag(
    spec: RagSpec,
) -> tuple[list[int], list[list[int]], list[tuple[list[int], tuple[int, ...]]]]:
    """The system prompt, the documents, and each request's prompt with its documents."""
    system, documents, draw = _rag_corpus(spec)
    popularity = 1.0 / np.arange(1, spec.documents + 1) ** spec.zipf
    popularity /= popularity.sum()
    prompts = []
    for _ in range(spec.requests):
        count = min(spec.documents, draw.length(spec.docs_per_request))
        chosen = tuple(int(d) for d in draw.rng.choice(spec.documents, count, False, popularity))
        prompt = system + [t for d in chosen for t in documents[d]]
        prompts.append((prompt + draw.tokens(spec.question_tokens), chosen))
    return system, documents, prompts


def _rag_corpus(spec: RagSpec) -> tuple[list[int], list[list[int]], _Draw]:
    """The system prompt and the documents, and the generator, ready for the questions."""
    draw = _Draw(np.random.default_rng(spec.seed), spec.vocab_size)
    system = draw.tokens((spec.system_tokens, spec.system_tokens))
    return system, [draw.tokens(spec.doc_tokens) for _ in range(spec.documents)], draw


def rag_trace(spec: RagSpec) -> list[TraceRequest]:
    """The RAG workload; arrivals and output lengths come from their own
    stream, so the prompts do not depend on them."""
    timing = np.random.default_rng([spec.seed, 1])
    arrivals = _arrivals(timing, spec.requests, spec.rate)
    trace = []
    system, documents, prompts = _rag(spec)
    if spec.prime:
        for d, document in enumerate(documents):
            primer = tuple(system + document)
            trace.append(TraceRequest(f"prime-{d:03d}", 0.0, primer, 1, f"doc {d}", warm=True))
    for i, (prompt, docs) in enumerate(prompts):
        label = "docs " + "+".join(str(d) for d in docs)
        output = int(timing.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
        trace.append(TraceRequest(f"rag-{i:04d}", arrivals[i], tuple(prompt), output, label))
    return trace


def chat_trace(spec: ChatSpec) -> list[TraceRequest]:
    """The multi-turn chat workload, ordered by arrival."""
    draw = _Draw(np.random.default_rng(spec.seed), spec.vocab_size)
    system = draw.tokens((spec.system_tokens, spec.system_tokens))
    starts = _arrivals(draw.rng, spec.sessions, spec.rate)
    trace = []
    for session, start in enumerate(starts):
        prompt, at = list(system), start
        for turn in range(draw.length(spec.turns)):
            prompt += draw.tokens(spec.user_tokens)
            output = draw.length(spec.output_tokens)
            request_id = f"chat-{session:03d}-{turn:02d}"
            label = f"session {session} turn {turn}"
            trace.append(TraceRequest(request_id, at, tuple(prompt), output, label))
            prompt += draw.tokens((output, output))  # the stand-in answer
            at += float(draw.rng.exponential(spec.think_s)) if spec.think_s else 0.0
    return sorted(trace, key=lambda r: (r.arrival_s, r.id))


__all__ = [
    "ChatSpec",
    "RagSpec",
    "TraceRequest",
    "chat_trace",
    "rag_prompts",
    "rag_trace",
]
