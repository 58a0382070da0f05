"""``Router``: the scoring path, with no HTTP in it.

``route(tokens, salt)`` hashes the prompt as the engines' connectors do
(``docs/hashing.md``, with the namespace the cache servers report and the
tenant's salt), reads both indexes, builds every live engine's candidate
features, plans each (``scoring.score``, with the work weight of the
cluster's measured load, ``load.py``) and lets the policy pick. The caller
then brackets the request with ``dispatched`` / ``first_token`` /
``finished`` (or ``failed``), which keep each engine's queue (a projected
drain time, ``queue.py``) and teach the cost model. The chunks a request was
routed with are credited to its node until the node's cache server announces
them or ``ChunkIndex.pending_ttl_s`` passes, so a second request for a
prefix still being prefilled sees where it went.

Engines are ``Node``s, numbered from 0 in configuration order; node ``i``'s
engine and cache server share a machine (the cache server's L1 is that
engine's). A node is taken out on failure for ``down_s`` and comes back by
itself (the next request tries it again).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.keys import TokenHasher, key_namespace
from kvtier.router.blocks import BlockIndex
from kvtier.router.chunks import ChunkIndex
from kvtier.router.cost import CostModel, Observation
from kvtier.router.load import ClusterLoad
from kvtier.router.queue import PrefillQueue, ServiceLine
from kvtier.router.scoring import Decision, make_policy, score

HASHERS = 256  # (namespace, tenant) hashers kept


class NoEngine(Exception):
    """No engine can take the request now (all down, or all excluded)."""


@dataclass(eq=False)
class Node:
    """One engine and its node's cache server. Mutable fields: the router's lock."""

    index: int
    name: str
    url: str  # the engine's OpenAI-compatible base URL
    cache_url: str = ""  # the cache server's admin HTTP ("" none)
    max_model_len: int = 0  # 0: unknown (the engine's /v1/models tells)
    queue: PrefillQueue = field(default_factory=PrefillQueue)  # prefills without a first token
    line: ServiceLine = field(default_factory=ServiceLine)  # the same, as it really went
    inflight_requests: int = 0
    down_until: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    routed: int = 0

    def live(self, now: float) -> bool:
        return self.down_until <= now


@dataclass(slots=True)
class Routed:
    """A decision and what it needs to report back."""

    decision: Decision
    hashes: list[bytes]  # the prompt's kvtier chunk hashes
    started: float
    planned_at: float = 0.0  # its projected first token (set when dispatched)
    routed_to: int = 0  # its node's requests routed, itself included (set when dispatched)

    @property
    def service_s(self) -> float:
        """Its own planned prefill and loads, the wait excluded."""
        return self.decision.expected_ttft_s - self.decision.queue_s


class Router:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        nodes: Sequence[Node],
        policy: str = "kvtier",
        cost: CostModel | None = None,
        chunks: ChunkIndex | None = None,
        blocks: BlockIndex | None = None,
        down_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not nodes:
            raise ValueError("a router needs at least one engine")
        self.nodes = list(nodes)
        self.policy_name = policy
        self.policy = make_policy(policy)
        self.cost = cost or CostModel()
        self.chunks = chunks or ChunkIndex(max_nodes=max(64, len(self.nodes)))
        self.blocks = blocks or BlockIndex()
        self.down_s = down_s
        self._clock = clock
        self._lock = threading.Lock()
        self.load = ClusterLoad()
        self.namespace: dict[str, Any] | None = None  # the cache servers' (salt aside)
        self._hashers: OrderedDict[tuple[str, str], TokenHasher] = OrderedDict()

    # ------------------------------------------------------------- scoring

    def set_namespace(self, entry: dict[str, Any]) -> None:
        """The namespace the cache servers report (``/status`` ``hash_namespaces``)."""
        with self._lock:
            if entry != self.namespace:
                self.namespace = dict(entry)
                self._hashers.clear()

    def chunk_hashes(self, tokens: npt.NDArray[np.uint32], salt: str) -> tuple[list[bytes], int]:
        """The prompt's kvtier chunk hashes under ``salt`` (the request's
        ``cache_salt`` as given: ``key_namespace`` labels it, as the engines'
        identities do) and the chunk size (none until a cache server has
        reported its namespace)."""
        with self._lock:
            entry = self.namespace
            if entry is None:
                return [], 0
            key = (repr(sorted(entry.items())), salt)
            hasher = self._hashers.get(key)
            if hasher is None:
                fields = {k: v for k, v in entry.items() if k != "chunk_size"}
                namespace = key_namespace(**fields, salt=salt)
                hasher = self._hashers[key] = TokenHasher(namespace, int(entry["chunk_size"]))
                while len(self._hashers) > HASHERS:
                    self._hashers.popitem(last=False)
            else:
                self._hashers.move_to_end(key)
        return hasher.chunk_hashes(tokens), hasher.chunk_size

    def route(
        self, tokens: npt.NDArray[np.uint32], salt: str, exclude: Sequence[int] = ()
    ) -> Routed:
        """Pick an engine for a prompt; ``NoEngine`` when none is live."""
        started = self._clock()
        hashes, chunk_size = self.chunk_hashes(tokens, salt)
        view = self.chunks.view(hashes)
        engine = self.blocks.prefix_tokens(tokens, salt) if len(self.blocks) else {}
        with self._lock:
            live = [n for n in self.nodes if n.live(started) and n.index not in exclude]
            if not live:
                raise NoEngine("no engine is up (all failed lately, or excluded)")
            indices = [n.index for n in live]
            queue = [n.queue.tokens for n in live]
            queue_s = [n.queue.wait_s(started) for n in live]
            requests = [n.inflight_requests for n in live]
            work_weight = self.load.work_weight(started, len(live))
        slots = self.chunks.slot_names()
        stores = self.chunks.store_names()
        candidates = score(
            indices,
            len(tokens),
            max(chunk_size, 1),
            queue,
            queue_s,
            requests,
            [engine.get(i, 0) for i in indices],
            view,
            slots,
            stores,
            dict(self.chunks.store_readers),
            self.cost,
            work_weight,
        )
        return Routed(candidates.decision(self.policy(candidates)), hashes, started)

    # ---------------------------------------------------------- bookkeeping

    def dispatched(self, routed: Routed) -> None:
        decision = routed.decision
        now = self._clock()
        with self._lock:
            node = self.nodes[decision.node]
            routed.planned_at = node.queue.dispatch(now, routed.service_s, decision.prefill_tokens)
            self.load.dispatch(now, routed.service_s)
            node.inflight_requests += 1
            node.routed += 1
            routed.routed_to = node.routed
            node.line.dispatched(routed.routed_to, now)
        self.chunks.note_routed(decision.node, routed.hashes)

    def first_token(self, routed: Routed, ttft_s: float) -> None:
        """The prefill is over: out of the queue, and a lesson for the cost model."""
        decision = routed.decision
        now = self._clock()
        with self._lock:
            node = self.nodes[decision.node]
            node.queue.first_token(now, routed.planned_at, decision.prefill_tokens)
            served = node.line.first_token(routed.routed_to, now)
            alone = not decision.queue_tokens and node.routed == routed.routed_to
        self.cost.observe(
            Observation(
                decision.node,
                ttft_s,
                decision.queue_s,
                decision.prefill_tokens,
                decision.loaded,
                alone,
                served,
            )
        )

    def finished(self, routed: Routed, *, prefilled: bool) -> None:
        with self._lock:
            node = self.nodes[routed.decision.node]
            node.inflight_requests -= 1
            node.line.left(routed.routed_to)
            if not prefilled:
                node.queue.cancel(
                    self._clock(),
                    routed.planned_at,
                    routed.service_s,
                    routed.decision.prefill_tokens,
                )

    def live_nodes(self) -> list[Node]:
        """The engines up now, the least busy first (for work outside a plan:
        tokenizing a prompt)."""
        now = self._clock()
        with self._lock:
            live = [n for n in self.nodes if n.live(now)]
            return sorted(live, key=lambda n: (n.inflight_requests, n.index))

    def failed(self, node_index: int, reason: str) -> None:
        """Take the engine out for ``down_s``; count why."""
        with self._lock:
            node = self.nodes[node_index]
            node.down_until = self._clock() + self.down_s
            node.failures[reason] = node.failures.get(reason, 0) + 1

    def status(self) -> dict[str, object]:
        now = self._clock()
        with self._lock:
            nodes = [
                {
                    "name": n.name,
                    "url": n.url,
                    "live": n.live(now),
                    "inflight_tokens": n.queue.tokens,
                    "queue_s": round(n.queue.wait_s(now), 4),
                    "inflight_requests": n.inflight_requests,
                    "routed": n.routed,
                    "failures": dict(n.failures),
                }
                for n in self.nodes
            ]
            live = sum(n.live(now) for n in self.nodes)
            utilisation = self.load.utilisation(now, live)
        return {
            "policy": self.policy_name,
            "utilisation": round(utilisation, 3),
            "namespace": self.namespace,
            "nodes": nodes,
            "chunks": self.chunks.status(),
            "blocks": self.blocks.status(),
            "cost": self.cost.status(),
        }


__all__ = ["NoEngine", "Node", "Routed", "Router"]
