"""Replay a trace against an OpenAI-compatible server, open loop.

Every request is sent at its arrival time whatever the server is doing (so a
slow configuration queues, as it would in production), as a streamed
``/v1/completions`` of token ids: greedy, ``ignore_eos``, ``max_tokens`` from
the trace, ``return_token_ids`` (the generated ids, to compare outputs across
configurations) and a final usage chunk (vLLM's ``cached_tokens``: the prompt
tokens its prefix cache and its connector supplied). TTFT is the time from
sending to the first generated token; each later token's gap is an ITL
sample (tokens that arrive together share their chunk's gap).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvtier.traces import TraceRequest

REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class RequestResult:
    id: str
    arrival_s: float  # when the trace says to send it
    sent_s: float = 0.0  # when it was sent, seconds after the replay started
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # after sending, per token
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def finished_s(self) -> float:
        """When the last token came, seconds after the replay started."""
        return self.sent_s + (self.token_times_s[-1] if self.token_times_s else 0.0)

    def itls(self) -> list[float]:
        times = self.token_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]


def _record_chunk(result: RequestResult, data: dict[str, object], at: float) -> None:
    choices = data.get("choices")
    if isinstance(choices, list) and choices:
        ids = choices[0].get("token_ids") or []
        if ids and result.ttft_s is None:
            result.ttft_s = at
        result.tokens.extend(int(t) for t in ids)
        result.token_times_s.extend([at] * len(ids))
    usage = data.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: TraceRequest,
    started: float,
    headers: Mapping[str, str] | None = None,
) -> RequestResult:
    """Send one request now; never raises (a failure is ``error``)."""
    result = RequestResult(request.id, request.arrival_s)
    body = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    sent = time.perf_counter()
    result.sent_s = sent - started
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {text}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line.removeprefix("data: "))
                if "error" in data:
                    result.error = str(data["error"])[:300]
                    return result
                _record_chunk(result, data, time.perf_counter() - sent)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if result.ttft_s is None:
        result.error = "no token came back"
    elif len(result.tokens) != request.output_tokens:
        result.error = f"{len(result.tokens)} tokens came back, not {request.output_tokens}"
    return result


async def replay(
    url: str,
    model: str,
    trace: Sequence[TraceRequest],
    on_result: Callable[[RequestResult], None] = lambda result: None,
    started: float | None = None,
    headers_of: Callable[[TraceRequest], Mapping[str, str]] | None = None,
) -> list[RequestResult]:
    """Send every request at its arrival time (seconds after ``started``,
    default now); results in trace order."""
    started = time.perf_counter() if started is None else started
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(request: TraceRequest) -> RequestResult:
            delay = started + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = headers_of(request) if headers_of is not None else None
            result = await send(session, url, model, request, started, headers)
            on_result(result)
            return result

        return list(await asyncio.gather(*(one(r) for r in trace)))


__all__ = ["RequestResult", "replay", "send"]
