"""Prefill/decode disaggregation through the cache server: the connector's two
roles in a hand-off (``kvtier.server.handoff.table`` holds it in between;
``kvtier.protocol.handoff`` names its parameters and outcomes).

A request's ``kv_transfer_params`` decide, as a proxy (``kvtier pd-proxy``)
sets them:

- ``{"do_remote_decode": true}``: this engine *produces*. It prefills the
  prompt (the proxy asks for one token), stores every prompt chunk and the
  prompt's trailing partial chunk (its tail), and when vLLM finishes the
  request offers them under a hand-off id. The stores are committed by then
  (``wait_for_save`` commits before the step returns), so vLLM frees the
  blocks at once. The response's ``kv_transfer_params`` carry what the
  consumer needs (``handoff_params``).
- ``{"do_remote_prefill": true, "kvtier_handoff": id,
  "kvtier_prompt_tokens": P}``: this engine *consumes*. Its prompt is the
  producer's P tokens and the first token the producer sampled. It takes the
  hand-off (one TAKE in flight per request, polled each step: the scheduler
  never waits for it; each names the request's token, so a take sent again
  over a new connection is still this request's), loads the P tokens' KV as
  an asynchronous load (the request waits for remote KV while the engine
  runs the others), computes only the last token, and tells the server it
  is done. A producer of
  another TP size (``kvtier_ranks``) is no obstacle: the take also names the
  prompt's chunks under the producer's layout, and the server re-shards them
  into this engine's ranks before it grants the take; likewise a producer of
  another block size (``kvtier_page_format``), whose vLLM CPU pages the
  server re-pages (``kvtier.layout.repage``). Nor is a producer on
  another node (``kvtier_server``, its cache server's boot id, is not this
  engine's): the take asks this engine's server to find the chunks in its
  tiers, where the producer's server writes them back (a shared L2).

A hand-off that does not come (never offered within ``handoff_wait_s``: the
producer died; expired; taken by another consumer; another layout; the
server away) ends with the request's policy, ``kvtier_on_failure`` else
``kvtier.handoff_failure``: ``recompute`` (counted, and named in the
response's ``kv_transfer_params``) or ``error`` (every block of the load is
reported failed, and vLLM, with ``kv_load_failure_policy: fail``, fails the
request).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient, PendingReply
from kvtier.protocol.handoff import (
    BAD_PARAMS,
    CAUSE,
    CONSUME,
    CONSUMER,
    ERROR,
    FAIL,
    HANDOFF_ID,
    INCOMPLETE_LOAD,
    LOADED,
    NOT_OFFERED,
    ON_FAILURE,
    OUTCOME,
    PAGES,
    POLICIES,
    PRODUCE,
    PROMPT_TOKENS,
    RANKS,
    RECOMPUTED,
    REFUSED,
    SERVER,
    SERVER_AWAY,
    WAITING,
    HandoffOutcome,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Produce:
    handoff_id: str
    consumer: str
    tail: bytes | None  # the hash of the prompt's partial chunk (None: it has none)
    tail_stored: bool = False


@dataclass(slots=True)
class Consume:
    handoff_id: str
    prompt_tokens: int  # P: the tokens whose KV the producer computed
    policy: str
    deadline: float  # when a hand-off still not offered means its producer is gone
    consumer: str
    producer_ranks: int = 0  # the producer's TP size (0: this engine's)
    producer_server: str = ""  # the boot id of the producer's cache server ("": unknown)
    producer_format: str = ""  # the producer's page format ("": not given, this engine's)
    source_hashes: list[bytes] = field(default_factory=list)  # the prompt under its layout
    kv_heads: int = 0  # the model's KV heads, for the server's re-sharding
    # Its takes' token: a take sent again over a new connection is still this request's.
    taker: str = field(default_factory=lambda: secrets.token_hex(8))
    call: PendingReply | None = None  # the TAKE in flight
    unanswered: bool = False  # the last TAKE got no answer: the server is away
    outcome: str = ""  # once settled: "granted", or why not
    cause: str = ""  # the server's words, if any
    done_sent: bool = False

    @property
    def settled(self) -> bool:
        return bool(self.outcome)

    @property
    def granted(self) -> bool:
        return self.outcome == HandoffOutcome.GRANTED


def role_of(
    params: Mapping[str, Any] | None,
    request_id: str,
    prompt_tokens: int,
    default_policy: str,
    wait_s: float,
    now: float,
    consumer: str,
) -> Produce | Consume | None:
    """The request's role from its ``kv_transfer_params`` (None: neither).
    Malformed parameters make a consumer that has already failed
    (``bad_params``), never an exception in vLLM's scheduler."""
    if not params:
        return None
    if params.get(PRODUCE):
        suffix = secrets.token_hex(8)
        return Produce(f"{request_id[:200]}-{suffix}", str(params.get(CONSUMER) or ""), None)
    if not params.get(CONSUME) or HANDOFF_ID not in params:
        return None  # another connector's transfer: not ours
    policy = params.get(ON_FAILURE, default_policy)
    consume = Consume(
        str(params.get(HANDOFF_ID)),
        0,
        policy if policy in POLICIES else default_policy,
        now + wait_s,
        consumer,
    )
    tokens, ranks = params.get(PROMPT_TOKENS), params.get(RANKS, 0)
    pages = params.get(PAGES, "")
    fits = isinstance(tokens, int) and 0 < tokens < prompt_tokens
    layout = _count(ranks) and isinstance(pages, str) and len(pages) <= 128
    if not fits or not layout or policy not in POLICIES or not consume.handoff_id:
        log.warning(
            "kvtier: %s: bad hand-off parameters %s=%r %s=%r %s=%r %s=%r %s=%r (the prompt has "
            "%d tokens: the producer's and its first token)",
            request_id,
            HANDOFF_ID,
            params.get(HANDOFF_ID),
            PROMPT_TOKENS,
            tokens,
            ON_FAILURE,
            policy,
            RANKS,
            ranks,
            PAGES,
            pages,
            prompt_tokens,
        )
        consume.outcome = BAD_PARAMS
        return consume
    consume.prompt_tokens = int(tokens)  # type: ignore[arg-type]
    consume.producer_ranks = int(ranks)
    consume.producer_server = str(params.get(SERVER) or "")
    consume.producer_format = str(pages)
    return consume


def _count(value: object) -> bool:
    """A TP size as a hand-off's parameters carry it (0: not given)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1024


def poll_take(
    consume: Consume,
    client: CacheClient | None,
    hashes: list[bytes],
    now: float,
    block_s: float = 0.0,
) -> None:
    """Advance the TAKE one step: send one if none is in flight (while the
    wait for an offer lasts), read its answer if it came (within
    ``block_s``), and settle on anything but ``pending``. A TAKE left
    unanswered (the client gave up on a quiet server) is sent again next
    step: the hand-off may still come while the wait lasts, and a server
    still away when it ends makes the cause ``server_away``."""
    if consume.settled:
        return
    if client is None:
        consume.outcome = SERVER_AWAY
        return
    if consume.call is None:
        if now >= consume.deadline:
            consume.outcome = SERVER_AWAY if consume.unanswered else NOT_OFFERED
            return
        take = p.HandoffTake(
            consume.handoff_id,
            hashes,
            consume.consumer,
            source_hashes=consume.source_hashes,
            kv_heads=consume.kv_heads,
            find=offered_elsewhere(consume, client),
            taker=consume.taker,
        )
        consume.call = client.handoff(take)
    call = consume.call
    if block_s > 0 and not call.ready:
        call.wait(block_s)
    if not call.ready:
        return
    consume.call = None
    reply = call.reply
    consume.unanswered = reply is None
    if isinstance(reply, p.HandoffState):
        if reply.outcome not in WAITING:
            consume.outcome, consume.cause = reply.outcome, reply.message
    elif isinstance(reply, p.Error):
        consume.outcome, consume.cause = REFUSED, f"{reply.code}: {reply.message}"


def offered_elsewhere(consume: Consume, client: CacheClient) -> bool:
    """Whether the hand-off was offered on another cache server than the one
    ``client`` is registered with now (its take then asks this one to find
    the chunks in its tiers). Decided for each take, not once per request:
    a client learns that its server restarted (the new boot id) only when it
    next hears from it, so the first take may go out under the old one."""
    return bool(consume.producer_server) and client.boot_id != consume.producer_server


def handoff_params(
    produce: Produce, prompt_tokens: int, ranks: int, server: str, page_format: str
) -> dict[str, Any]:
    """What the producer's response tells the proxy to pass the consumer."""
    return {
        CONSUME: True,
        HANDOFF_ID: produce.handoff_id,
        PROMPT_TOKENS: prompt_tokens,
        CONSUMER: produce.consumer,
        RANKS: ranks,
        SERVER: server,
        PAGES: page_format,
    }


def consumer_outcome(consume: Consume, loaded: bool) -> dict[str, Any]:
    """What the consumer's response says about its hand-off."""
    if loaded:
        return {HANDOFF_ID: consume.handoff_id, OUTCOME: LOADED}
    outcome = ERROR if consume.policy == FAIL else RECOMPUTED
    cause = consume.outcome if consume.outcome != HandoffOutcome.GRANTED else INCOMPLETE_LOAD
    return {HANDOFF_ID: consume.handoff_id, OUTCOME: outcome, CAUSE: cause}
