"""Random client traffic for a robustness run: one worker per tenant, each a
``CacheClient`` of its tenant plus two consumer clients for hand-off races.

Both tenants use the same prompts, so the same chunk hashes: only their
salts keep them apart. Each tenant's payload for a (prompt, chunk) is its
own (seeded by tenant and prompt), so bytes served to the wrong tenant are
recognised. A worker's operations come from its own seeded generator:

| weight | operation | what it does                                                  |
|--------|-----------|---------------------------------------------------------------|
| 35     | store     | store the first 1-4 chunks of a prompt                         |
| 35     | read      | look the prompt up, retrieve every hit chunk, end the session |
| 8      | partial   | look up, retrieve the first hit chunks, release the rest      |
| 10     | handoff   | store a prompt, offer it (a 5 s lease), two consumers race to take it |
| 8      | pin       | pin a prompt's chunks for 1-5 s                                |
| 4      | purge     | purge the tenant (admin API), wait until the job ends          |

Each operation's bound is its calls' documented timeouts added up (the
client's request timeout and grace per call, a lookup's wait) plus
``SLACK_S`` for a busy machine.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import numpy as np

from kvtier.commands.admin import AdminError
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.protocol.connection import GRACE_S
from tests.integration import workload as w
from tests.robustness.background import Background
from tests.robustness.cluster import TIMEOUT_S, TOKENS, Cluster
from tests.robustness.history import History, digest

CHUNK = 256  # the server's chunk size
CHUNKS = 4  # a prompt's chunks
PROMPTS = 24  # prompts per run, shared by the tenants: several times what L1 holds
WAIT_S = TIMEOUT_S + 1.0  # a lookup's wait: past the server's L2 deadline
SLACK_S = 3.0
PURGE_WAIT_S = 30.0
LONGEST_HOLD_S = 5.0  # a pin's TTL and a hand-off's lease at most: what outlives a worker
SIZE = w.object_bytes(CHUNK)
log = logging.getLogger(__name__)
HASHES = [w.chunk_hashes(CHUNK, 7000 + prompt, CHUNKS) for prompt in range(PROMPTS)]


def bound(calls: int, wait_s: float = 0.0) -> float:
    """A caller waits up to the request timeout and the client's grace per call."""
    return calls * (TIMEOUT_S + GRACE_S) + wait_s + SLACK_S


class TenantWorker(Background):
    """Runs one tenant's operations on its own thread until ``stop`` is set
    and it has done at least ``min_ops``; ``done`` counts them."""

    def __init__(
        self, tenant: str, cluster: Cluster, history: History, seed: int, min_ops: int
    ) -> None:
        super().__init__(f"traffic-{tenant}")
        self.tenant, self.cluster, self.history = tenant, cluster, history
        self.rng = random.Random(f"{seed}-{tenant}")
        self.min_ops = min_ops
        self.done = 0
        self.number = sorted(TOKENS).index(tenant)
        self.clients = [CacheClient(self._config(i)) for i in range(3)]

    def _config(self, i: int) -> w.ClientConfig:
        address = self.cluster.server.rpc
        return w.client_config(
            address,
            auth_token=TOKENS[self.tenant],
            client_id=f"{self.tenant}-{i}",
            request_timeout_s=TIMEOUT_S,
            retry_s=0.2,
        )

    def close(self) -> None:
        super().close()
        for client in self.clients:
            client.close()

    def _run(self) -> None:
        operations: list[tuple[int, Callable[[int], None]]] = [
            (35, self.store),
            (35, self.read),
            (8, self.partial_read),
            (10, self.handoff),
            (8, self.pin),
            (4, self.purge),
        ]
        weights = [weight for weight, _ in operations]
        while not (self.stop.is_set() and self.done >= self.min_ops):
            (_, operation), prompt = (
                self.rng.choices(operations, weights)[0],
                self.rng.randrange(PROMPTS),
            )
            try:
                operation(prompt)
            except Exception:  # recorded in the history (the never_raises rule), go on
                log.exception("robustness: %s raised", self.tenant)
            self.done += 1
            time.sleep(self.rng.uniform(0.0, 0.05))

    def _payloads(self, prompt: int, chunks: int) -> list[np.ndarray]:
        return w.payloads(1000 * self.number + prompt, chunks, SIZE)

    def store(self, prompt: int, chunks: int | None = None) -> None:
        chunks = chunks or self.rng.randint(1, CHUNKS)
        buffers = self._payloads(prompt, chunks)
        with self.history.record(
            self.tenant, "store", bound(2), tenant=self.tenant, prompt=prompt, chunks=chunks
        ) as op:
            op.result["digests"] = [digest(b) for b in buffers]
            stored = self.clients[0].store(f"s{op.index}", HASHES[prompt][:chunks], buffers)
            op.outcome, op.result["stored"] = "ok", stored

    def read(self, prompt: int, partial: bool = False) -> None:
        client = self.clients[0]
        with self.history.record(
            self.tenant,
            "read",
            bound(3, WAIT_S),
            tenant=self.tenant,
            prompt=prompt,
            partial=partial,
        ) as op:
            request = f"r{op.index}"
            hit = client.lookup(request, HASHES[prompt], wait_s=WAIT_S).hit_chunks or 0
            op.result["hit"] = hit
            share = self.rng.random()  # drawn whatever the hit: the seed's stream stays the same
            take = max(1, round(share * hit)) if partial and hit else hit
            out = w.empty_buffers(take, SIZE)
            ok = take > 0 and client.retrieve_into(request, 0, take, out)
            if partial and take < hit:
                client.release(request, take, hit)
            client.end_session(request)
            op.result["digests"] = [digest(b) for b in out] if ok else []
            op.outcome = "ok" if ok else "miss"

    def partial_read(self, prompt: int) -> None:
        self.read(prompt, partial=True)

    def handoff(self, prompt: int) -> None:
        self.store(prompt, CHUNKS)
        handoff = f"{self.tenant}-h{len(self.history.ops)}"
        producer, *consumers = self.clients
        with self.history.record(
            self.tenant, "offer", bound(1), tenant=self.tenant, prompt=prompt, handoff=handoff
        ) as op:
            reply = producer.handoff(p.HandoffOffer(handoff, HASHES[prompt], LONGEST_HOLD_S)).wait()
            op.outcome = "ok" if isinstance(reply, p.HandoffState) else "error"
            op.result["outcome"] = getattr(reply, "outcome", None)
        racers = [
            threading.Thread(target=self._take, args=(consumer, i, handoff, prompt))
            for i, consumer in enumerate(consumers)
        ]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()

    def _take(self, consumer: CacheClient, i: int, handoff: str, prompt: int) -> None:
        with self.history.record(
            f"{self.tenant}-c{i}",
            "take",
            bound(2),
            tenant=self.tenant,
            prompt=prompt,
            handoff=handoff,
        ) as op:
            reply = consumer.handoff(p.HandoffTake(handoff, HASHES[prompt])).wait()
            outcome = getattr(reply, "outcome", None)
            op.result = {"outcome": outcome, "boot": consumer.boot_id}
            op.outcome = "ok" if isinstance(reply, p.HandoffState) else "error"
            if outcome == "granted":
                consumer.handoff(p.HandoffDone(handoff)).wait()

    def pin(self, prompt: int) -> None:
        ttl_s = round(self.rng.uniform(1.0, LONGEST_HOLD_S), 1)
        with self.history.record(
            self.tenant, "pin", bound(1), tenant=self.tenant, prompt=prompt, ttl_s=ttl_s
        ) as op:
            pinned = self.clients[0].pin(HASHES[prompt], ttl_s)
            op.outcome = "ok" if pinned is not None else "error"

    def purge(self, prompt: int) -> None:
        with self.history.record(self.tenant, "purge", tenant=self.tenant) as op:
            try:
                started = self.cluster.admin("POST", "/admin/purge", {"tenant": self.tenant})
                job = started["jobs"][0]
                deadline = time.monotonic() + PURGE_WAIT_S
                state = "running"
                while state == "running" and time.monotonic() < deadline:
                    time.sleep(0.1)
                    jobs = self.cluster.admin("GET", "/admin/purges")["purges"]
                    state = next((j["state"] for j in jobs if j["id"] == job), "gone")
            except (AdminError, KeyError, IndexError) as exc:
                op.outcome, op.result = "error", {"refused": str(exc)}  # e.g. the server is down
                return
            op.outcome = "ok" if state == "done" else state
            op.result = {"job": job, "state": state}
