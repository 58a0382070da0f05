"""The connector's scheduler side (vLLM's EngineCore process).

Per request (``Tracked``): its prompt's chunk hashes, one lookup, and what
has been loaded and stored. The lookup state machine is the client's
``LookupState`` (submitted -> acked -> pending -> done(n)): a request whose
lookup is still pending is deferred (``None``) and asked again next step; a
done lookup never changes, so asking again never counts a hit twice. A
request re-admitted after preemption (its KV freed) is looked up afresh.

Locks: the server read-locks the hit chunks at lookup. Chunks the engine has
itself or will compute are released at ``update_state_after_alloc``; chunks
being loaded are released once the step that loaded them has come back
(``update_connector_output``; an asynchronous load's, once every rank has
finished it); ``request_finished`` ends the session, which
releases anything left, whether the request finished, was aborted or failed.

Loads are synchronous by default (the worker copies before the step's
forward). With ``kvtier.load_async`` the hit is offered as an asynchronous
load: vLLM allocates its blocks and parks the request (waiting for remote
KV) while a worker thread copies; the chunks stay locked until every rank
has reported the load finished, and a request vLLM asks about again after
its load came back (the load failed and vLLM freed its blocks) is offered
nothing. Either way the hit offered is at most ``num_tokens - 1``: a full hit
still computes the last prompt token. Stores are emitted for prompt chunks
that this step completes.

Each finished lookup is logged at debug level with why its hit ends where it
does (``LookupState.miss_reason``), and counted; the counts are logged with
the step timings. With ``kvtier.shadow_fraction``, a sampled request is
offered one chunk less than its hit: vLLM computes that chunk (the last one
it would have loaded), and the worker compares it with kvtier's copy after
the forward (``ShadowSpec``, ``kvtier.engine.shadow``).

With ``kvtier.pin_prefixes_file``, a request whose prompt starts with a
listed prefix (a system prompt) renews that prefix's pin in L1 once its
lookup shows the prefix's chunks in kvtier (``PrefixPins``). The block
arithmetic of one request's loads, stores and shadow checks is its
``Tracked``'s (``kvtier.engine.vllm.tracked``); its part in a prefill/decode
hand-off is its role (``kvtier.engine.vllm.handoff``), and what this side
does for that role is ``HandoffSteps`` (``kvtier.engine.vllm.handoff_steps``).

The scheduler thread never waits on the network beyond a small budget: the
new requests of a step wait together at most ``kvtier.lookup_wait_s`` for
their lookups' answers (then a request is deferred and polled next step,
without waiting), and not at all while hardly any answer has come within
that budget (one lookup in ``PROBE_EVERY`` still waits, to notice when they
speed up again); a request the server cannot be reached for is a miss,
counted ``no_server``. A request of a tenant (``cache_salt``) not seen before
makes that tenant's client, which waits no longer than the budget for its
HELLO; while that HELLO is out and the server answers the other tenants'
clients, the request is deferred like a late lookup, so a new tenant's
first request is looked up and stored like any other. Releases and
session ends are sent without waiting for their acks, and a client that lost
its server reconnects on its own thread. ``StepTimer`` measures what the
connector's scheduler calls take per step and logs a summary every
``LOG_EVERY_STEPS`` steps and at shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any

from kvtier.counters import Counters
from kvtier.engine.shadow import ShadowCheck
from kvtier.engine.vllm.blending import blend_request
from kvtier.engine.vllm.clients import ClientPool
from kvtier.engine.vllm.groups import block_lists
from kvtier.engine.vllm.handoff import Consume, Produce, poll_take, role_of
from kvtier.engine.vllm.handoff_steps import HandoffSteps
from kvtier.engine.vllm.metadata import (
    BlendSpec,
    KVTierMetadata,
    LoadSpec,
)
from kvtier.engine.vllm.pins import PrefixPins
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.timing import StepTimer
from kvtier.engine.vllm.tracked import Tracked
from kvtier.protocol.client import LookupState
from kvtier.read_or_recompute import ewma

log = logging.getLogger(__name__)
PROBE_EVERY = 16  # while lookups are slow, one new lookup in this many still waits
MIN_ON_TIME = 0.1  # new lookups wait while at least this share of waits gets its answer


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, settings: ConnectorSettings, kv_cache_config: Any = None
    ) -> None:
        self.settings = settings
        self.clients = ClientPool(
            vllm_config,
            settings,
            rank=-1,
            client_id="vllm-scheduler",
            connect_wait_s=settings.lookup_wait_s,  # a new tenant's client: within the budget
            kv_cache_config=kv_cache_config,
        )
        if settings.blend and self.clients.groups.window:
            raise ValueError(
                "kvtier.blend writes every layer's KV of the whole prompt; this model has "
                f"sliding-window layers (window {self.clients.groups.window}): unset kvtier.blend"
            )
        self.clients.client(settings.salt_for(None))  # the default tenant, registered up front
        self.timer = StepTimer()
        self.outcomes = Counters()  # finished lookups by miss reason ("hit": none)
        self.handoffs = HandoffSteps(self.clients, settings, self.outcomes)
        self.shadow = ShadowCheck(settings.shadow_fraction, settings.shadow_tolerance)
        self.block_size = self.clients.block_size
        self._store_all = settings.store != "none"  # else only a producer's chunks
        self._saving = (self._store_all, settings.save_async)  # what `Tracked.stores` asks
        self.requests: dict[str, Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._blends: list[BlendSpec] = []
        self._pins = PrefixPins(settings.pin_prefixes(), settings.pin_ttl_s)
        self._loading: deque[list[tuple[str, int, int]]] = deque()  # per step: (id, start, end)
        self._receiving: dict[str, tuple[str, int, int]] = {}  # asynchronous loads, by request
        self._step_wait_s = settings.lookup_wait_s  # what this step's lookups may still block
        self._on_time: float | None = None  # the share of waits the answer came within (EWMA)
        self._new_lookups = 0
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        self.engine_id = str(getattr(transfer, "engine_id", None) or "")  # a consumer's name

    # ------------------------------------------------------------ admission

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self.timer:
            return self._matched(request, num_computed_tokens)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self.requests.get(request.request_id)
        if tracked is None or tracked.preemptions != request.num_preemptions:
            salt = self.settings.salt_for(getattr(request, "cache_salt", None))
            if self.clients.awaiting_hello(salt):
                return None, False  # a new tenant: asked again next step, with its client
            tracked = self._track(request, salt)
        tracked.local = num_computed_tokens
        if tracked.blend is not None:
            return max(0, tracked.blend.written - num_computed_tokens), False
        client = tracked.client
        role = tracked.role
        if isinstance(role, Consume):
            started = time.perf_counter()
            poll_take(role, client, tracked.hashes, time.monotonic(), self._step_wait_s)
            self._step_wait_s = max(0.0, self._step_wait_s - (time.perf_counter() - started))
            if not role.settled:
                return None, False  # not offered yet: asked again next step
            if not role.granted:
                return self.handoffs.failed(tracked, role, request, num_computed_tokens)
        if client is None or not tracked.hashes:
            return 0, False
        wait = self.settings.lookup_wait_s
        if tracked.lookup is None:
            started = time.perf_counter()
            block = self._step_wait_s if self._worth_waiting() else 0.0
            tracked.lookup = client.lookup(
                request.request_id, tracked.hashes, wait_s=wait, block_s=block
            )
            self._step_wait_s = max(0.0, self._step_wait_s - (time.perf_counter() - started))
            if block >= wait / 2:  # a fair try: did the answer come while it waited?
                self._on_time = ewma(self._on_time, float(tracked.lookup.done))
        if not tracked.lookup.done and client.poll(tracked.lookup, wait) is None:
            return None, False  # pending: asked again next step, without waiting
        if tracked.received:
            return 0, False  # its load came back and vLLM asks again: it failed; recompute
        end = min((tracked.lookup.hit_chunks or 0) * tracked.chunk_size, request.num_tokens - 1)
        if not tracked.settled:
            self._settle(tracked, end)
        if tracked.shadow_chunk is not None:
            if tracked.shadow_chunk * tracked.chunk_size < num_computed_tokens:
                tracked.shadow_chunk = None  # the engine has that chunk itself now: no check
            else:
                end = tracked.shadow_chunk * tracked.chunk_size  # vLLM computes it
        offered = max(0, end - num_computed_tokens)
        return offered, self.settings.load_async and offered > 0

    def _worth_waiting(self) -> bool:
        """Whether a new lookup should block (within the step's budget) for
        its answer. A request whose answer comes later is deferred a step,
        and a step can be long (another request's prefill), so waiting pays
        whenever answers often come within the budget (L1 hits do in well
        under a millisecond). Only while hardly any has (``MIN_ON_TIME``: the
        lookup path itself is slow) does a lookup go out without waiting;
        one in ``PROBE_EVERY`` still waits, to see the path speed up."""
        self._new_lookups += 1
        on_time = self._on_time is None or self._on_time >= MIN_ON_TIME
        return on_time or self._new_lookups % PROBE_EVERY == 0

    def _settle(self, tracked: Tracked, end: int) -> None:
        """Count a finished lookup and choose whether to shadow-check it."""
        assert tracked.lookup is not None
        tracked.settled = True
        hit, reason = tracked.lookup.hit_chunks or 0, tracked.lookup.miss_reason
        self.outcomes.add(reason or "hit")
        log.debug(
            "kvtier: %s: %d of %d chunks hit%s",
            tracked.request_id,
            hit,
            len(tracked.hashes),
            f" ({reason})" if reason else "",
        )
        if tracked.pin is not None and tracked.client is not None:
            self._pins.renew(tracked.client, tracked.salt, tracked.pin, tracked.hashes, hit)
        last = end // tracked.chunk_size - 1  # the last chunk the hit offers whole
        checkable = (
            tracked.role is None and last >= 0 and last * tracked.chunk_size >= tracked.local
        )
        if checkable and self.shadow.sample():
            tracked.shadow_chunk = last

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        with self.timer:
            self._allocated(request, blocks, num_external_tokens)

    def _allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            return
        role = tracked.role
        if tracked.blend is not None:
            if num_external_tokens > 0:
                tokens = tracked.blend.written
                ids = blocks.get_block_ids()[0][: -(-tokens // self.block_size)]
                self._blends.append(dataclasses.replace(tracked.blend, block_ids=list(ids)))
            return
        if isinstance(role, Consume) and role.settled and not role.granted:
            if num_external_tokens > 0:  # the error policy: a load whose every block fails
                self._loads.append(
                    tracked.failed_load(
                        blocks, num_external_tokens, self.block_size, self.settings.load_async
                    )
                )
            return
        if tracked.client is None or tracked.lookup is None:
            return
        hit = tracked.lookup.hit_chunks or 0
        tracked.stored = hit
        if not tracked.lookup.done or hit == 0:
            return
        if num_external_tokens <= 0:
            tracked.client.release(request.request_id, 0, hit, wait=False)
            return
        spec = tracked.load_spec(
            blocks, num_external_tokens, self.block_size, self.settings.load_async
        )
        self._loads.append(spec)
        first, end = spec.first_chunk, spec.first_chunk + len(spec.hashes)
        if first > 0:  # the engine has these
            tracked.client.release(request.request_id, 0, first, wait=False)
        if end < hit:  # the engine computes these
            tracked.client.release(request.request_id, end, hit, wait=False)

    # ----------------------------------------------------------------- steps

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        self._step_wait_s = self.settings.lookup_wait_s  # the next step's budget
        with self.timer:
            meta = self._build(scheduler_output)
        if self.timer.step():  # once per step: what this step's connector calls took
            self._log_outcomes()
        return meta

    def _build(self, scheduler_output: Any) -> KVTierMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        meta = KVTierMetadata(loads=self._loads, computed_tokens=sum(scheduled.values()))
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.blends, self._loads, self._blends = self._blends, [], []
        step: list[tuple[str, int, int]] = []
        for spec in meta.loads:
            held = (spec.request_id, spec.first_chunk, spec.first_chunk + len(spec.hashes))
            if spec.failed:
                continue  # nothing is locked for a load that is to fail
            if spec.asynchronous:
                self._receiving[spec.request_id] = held
            else:
                step.append(held)
        self._loading.append(step)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = block_lists(new.block_ids)
                done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                meta.stores += tracked.stores(done, self.block_size, *self._saving)
                meta.shadows += tracked.shadows(done, self.block_size)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            tracked = self.requests.get(request_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                tracked.block_ids = block_lists(new_ids) if new_ids else []
            elif new_ids:
                for ids, more in zip(tracked.block_ids, new_ids, strict=True):
                    ids.extend(more)
            done = cached.num_computed_tokens[i] + scheduled.get(request_id, 0)
            meta.stores += tracked.stores(done, self.block_size, *self._saving)
            meta.shadows += tracked.shadows(done, self.block_size)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The step that loaded the oldest batch has come back, and the
        asynchronous loads the workers finished (every rank): unlock them."""
        with self.timer:
            done = list(self._loading.popleft()) if self._loading else []
            for request_id in getattr(connector_output, "finished_recving", None) or ():
                held = self._receiving.pop(request_id, None)
                tracked = self.requests.get(request_id)
                if held is not None and tracked is not None:
                    tracked.received = True
                    done.append(held)
            invalid = getattr(connector_output, "invalid_block_ids", None) or set()
            for request_id, start, end in done:
                tracked = self.requests.get(request_id)
                if tracked is not None and tracked.client is not None:
                    tracked.client.release(request_id, start, end, wait=False)
                    self.handoffs.consumed(tracked, whole=not tracked.load_blocks & invalid)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """End the request's session; for a hand-off, offer it (producer) or
        say how it went (consumer), in the response's ``kv_transfer_params``.
        Its blocks are held back (True) while stores of it that left their
        step may still read them: until every worker names it finished
        sending (``get_finished``)."""
        with self.timer:
            tracked = self.requests.pop(request.request_id, None)
            self._receiving.pop(request.request_id, None)  # the session's end releases it
            if tracked is None:
                return False, None
            if tracked.client is not None and _looked_up(tracked.lookup):
                tracked.client.end_session(request.request_id, wait=False)
            held, role = tracked.saves_after_step, tracked.role
            if isinstance(role, Produce):
                return held, self.handoffs.offer(tracked, role)
            if isinstance(role, Consume):
                return held, self.handoffs.finished(tracked, role, request)
        return held, None

    def close(self) -> None:
        self.timer.report()
        self._log_outcomes()
        self.clients.close()

    # ------------------------------------------------------------ internals

    def _track(self, request: Any, salt: str) -> Tracked:
        old = self.requests.get(request.request_id)
        if old is not None and old.client is not None and _looked_up(old.lookup):
            old.client.end_session(request.request_id, wait=False)  # preempted: start over
        client = self.clients.client(salt)
        chunk_size = client.chunk_size if client is not None else None
        prompt = list(request.prompt_token_ids or [])
        role = role_of(
            getattr(request, "kv_transfer_params", None),
            request.request_id,
            len(prompt),
            self.settings.handoff_failure,
            self.settings.handoff_wait_s,
            time.monotonic(),
            self.engine_id,
        )
        if old is not None and isinstance(old.role, Consume) and isinstance(role, Consume):
            self.handoffs.resume(old, role)
        if isinstance(role, Consume) and role.prompt_tokens:
            prompt = prompt[: role.prompt_tokens]  # the producer's prompt; its first token follows
        blend = self._blend_of(request, salt, prompt, role) if self.settings.blend else None
        hashes: list[bytes] = []
        if chunk_size is not None and blend is None:  # a blend stores and loads no chunks
            hasher = self.clients.hasher(salt, chunk_size)
            hashes = hasher.chunk_hashes(prompt)
            tail = hasher.tail_hash(prompt, hashes) if role is not None else None
            if isinstance(role, Produce):
                role.tail = tail
            elif tail is not None:
                hashes.append(tail)  # a consumer loads the producer's tail too
            if isinstance(role, Consume) and not role.settled:
                self.handoffs.name_source_chunks(role, prompt, salt, chunk_size)
        if client is None:
            self.outcomes.add("no_server")
        tracked = Tracked(
            request.request_id,
            salt,
            client,
            chunk_size or 0,
            hashes,
            len(prompt),
            request.num_preemptions,
            role=role,
            blend=blend,
            saves_after_step=old is not None and old.saves_after_step,  # the workers know it
        )
        if self._pins.prefixes:
            tracked.pin = self._pins.listed_prefix(prompt, chunk_size or 0)
        self.requests[request.request_id] = tracked
        return tracked

    def _blend_of(
        self, request: Any, salt: str, prompt: list[int], role: Produce | Consume | None
    ) -> BlendSpec | None:
        """The blend a request asks for (``kvtier.engine.vllm.blending``); a bad
        ask, or one beside a hand-off, is served without blending (logged,
        counted)."""
        try:
            asked = blend_request(getattr(request, "kv_transfer_params", None), len(prompt))
        except ValueError as e:
            self.outcomes.add("blend_bad_params")
            log.warning("kvtier: %s: not blended: %s", request.request_id, e)
            return None
        if asked is None:
            return None
        if role is not None:
            self.outcomes.add("blend_with_handoff")
            log.warning("kvtier: %s: not blended: a hand-off is exact KV", request.request_id)
            return None
        spans, config = asked
        self.outcomes.add("blend")
        return BlendSpec(request.request_id, salt, prompt, spans, config, [])

    def _log_outcomes(self) -> None:
        outcomes = self.outcomes.snapshot()
        if outcomes:
            shown = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            log.info("kvtier scheduler: lookups by outcome (since start): %s", shown)


def _looked_up(lookup: LookupState | None) -> bool:
    """A LOOKUP went out: the server may hold a session to end (its ack may
    still be on the way; END_SESSION goes after it on the same connection)."""
    return lookup is not None
