"""What the connector's scheduler side does for a prefill/decode hand-off
(the roles themselves are ``kvtier.engine.vllm.handoff``): a producer offers
its stored prompt when its request finishes; a consumer whose hand-off did
not come ends with its policy; a consumer's load that came back drops the
server's hold, once; a producer of another layout has its chunks named in
that layout too; a consumer preempted after its hand-off looks its chunks
up like any prompt. Every outcome is counted in the scheduler's
``outcomes`` and logged when something did not go as asked.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.counters import Counters
from kvtier.engine.vllm.clients import ClientPool
from kvtier.engine.vllm.handoff import Consume, Produce, consumer_outcome, handoff_params
from kvtier.engine.vllm.pages import latent_format
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.tracked import Tracked
from kvtier.protocol import messages as p
from kvtier.protocol.handoff import FAIL, NOT_OFFERED, HandoffOutcome

log = logging.getLogger(__name__)
FINISHED_NORMALLY = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # vLLM's RequestStatus names
NOT_STORED = (
    "its prompt's KV is not all stored (server away, or the request ended before its prefill did)"
)


class HandoffSteps:
    """The scheduler side's hand-off steps; see the module docstring."""

    def __init__(
        self, clients: ClientPool, settings: ConnectorSettings, outcomes: Counters
    ) -> None:
        self.clients = clients
        self.settings = settings
        self.outcomes = outcomes

    def failed(
        self, tracked: Tracked, role: Consume, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The request's policy for a hand-off that did not come: recompute
        (nothing offered), or an asynchronous load of the whole prompt that
        fails every block, which vLLM (``kv_load_failure_policy: fail``)
        turns into the request's error."""
        if not tracked.settled:
            tracked.settled = True
            self.outcomes.add(f"handoff_{role.policy}.{role.outcome}")
            log.warning(
                "kvtier: %s: hand-off %s did not come (%s%s): %s",
                request.request_id,
                role.handoff_id,
                role.outcome,
                f": {role.cause}" if role.cause else "",
                "the request fails" if role.policy == FAIL else "recomputing its prompt",
            )
        if role.policy == FAIL:
            offered = max(0, request.num_tokens - 1 - num_computed_tokens)
            return offered, self.settings.load_async and offered > 0
        return 0, False

    def offer(self, tracked: Tracked, role: Produce) -> dict[str, Any] | None:
        """Offer the producer's stored prompt for its consumer. The answer is
        awaited within the lookup budget, so that the offer is in before the
        response reaches the proxy (a later one only makes the consumer poll)
        and an offer the server finds incomplete is no hand-off at all. An
        offer the client's connection could not send (the server quiet for a
        moment) is held and sent once it is back, for as long as a consumer
        waits for it (``handoff_wait_s``)."""
        complete = tracked.stored == len(tracked.hashes) and (role.tail is None or role.tail_stored)
        why = NOT_STORED
        if tracked.client is not None and complete:
            hashes = tracked.hashes + ([role.tail] if role.tail is not None else [])
            offer = p.HandoffOffer(
                role.handoff_id,
                hashes,
                self.settings.handoff_lease_s,
                role.consumer,
                kv_heads=self.clients.kv_heads,
            )
            call = tracked.client.handoff(offer, hold_s=self.settings.handoff_wait_s)
            reply = call.wait(self.settings.lookup_wait_s)
            why = _not_offered(reply, call.ready)
        if tracked.client is None or why:
            self.outcomes.add("handoff_not_offered")
            log.warning("kvtier: %s: no hand-off: %s", tracked.request_id, why)
            return None
        self.outcomes.add("handoff_offered")
        server = tracked.client.boot_id or ""
        pages = self.clients.layout(tracked.chunk_size).format
        return handoff_params(role, tracked.prompt_tokens, self.clients.num_ranks, server, pages)

    def finished(self, tracked: Tracked, role: Consume, request: Any) -> dict[str, Any]:
        """A consumer's request ended: drop the server's hold and say how the
        hand-off went. A request that finished normally ran on its loaded KV:
        vLLM would have rescheduled it (recompute) or failed it had any block
        not loaded. This is how a one-token decode's synchronous load ends:
        its step finished the request before the step's connector output
        came back. Otherwise (aborted, failed) the load was cut short."""
        ran = getattr(getattr(request, "status", None), "name", "") in FINISHED_NORMALLY
        self.consumed(tracked, whole=ran and bool(tracked.load_blocks))
        return consumer_outcome(role, tracked.loaded)

    def consumed(self, tracked: Tracked, whole: bool) -> None:
        """A consumer's load came back (``whole``: every block): drop the
        server's hold on the hand-off, once (the DONE is held through a
        dropped connection, as long as the hold's lease)."""
        role = tracked.role
        if not isinstance(role, Consume) or not role.granted or role.done_sent:
            return
        role.done_sent = True
        hit = tracked.lookup.hit_chunks if tracked.lookup is not None else 0
        tracked.loaded = whole and hit == len(tracked.hashes)
        self.outcomes.add("handoff_loaded" if tracked.loaded else "handoff_load_incomplete")
        if tracked.client is not None:
            done = p.HandoffDone(role.handoff_id, role.consumer, taker=role.taker)
            tracked.client.handoff(done, hold_s=self.settings.handoff_lease_s)

    def name_source_chunks(
        self, role: Consume, prompt: list[int], salt: str, chunk_size: int
    ) -> None:
        """A producer of another TP size or block size hashed the prompt under
        its own layout: name those chunks too, for the server to convert."""
        own = self.clients.layout(chunk_size).format
        ranks = role.producer_ranks or self.clients.num_ranks
        pages = role.producer_format or own
        if ranks == self.clients.num_ranks and pages == own:
            return
        if latent_format(pages) != latent_format(own):
            role.outcome = HandoffOutcome.LAYOUT_MISMATCH
            role.cause = f"the producer's pages ({pages}) and this engine's ({own}): one is MLA"
            return
        try:
            hasher = self.clients.hasher(salt, chunk_size, ranks, pages)
        except ValueError as error:  # no TP split of this model's heads
            role.outcome, role.cause = HandoffOutcome.LAYOUT_MISMATCH, str(error)
            return
        source = hasher.chunk_hashes(prompt)
        tail = hasher.tail_hash(prompt, source)
        role.source_hashes = source + ([tail] if tail is not None else [])
        role.kv_heads = self.clients.kv_heads

    def resume(self, old: Tracked, role: Consume) -> None:
        """A consumer preempted after its hand-off: what it lost is its own
        blocks, not the hand-off. It takes nothing again: it looks its
        chunks up like any prompt (they stay in kvtier as cache entries),
        and recomputes what is gone, whatever its policy."""
        assert isinstance(old.role, Consume)
        self.consumed(old, whole=old.loaded)  # drop the server's hold if still held
        role.outcome, role.cause = old.role.outcome or NOT_OFFERED, old.role.cause
        role.done_sent, role.policy = True, "recompute"


def _not_offered(reply: p.Reply | None, answered: bool) -> str:
    """Why an offer is no hand-off ("": it is one, or may be: still on its way)."""
    if isinstance(reply, p.Error) or (
        isinstance(reply, p.HandoffState) and reply.outcome != HandoffOutcome.OFFERED
    ):
        return f"the server refused it ({reply})"
    if answered and reply is None:
        return "the server did not answer it (away, or the client closing)"
    return ""
