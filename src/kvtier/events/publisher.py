"""``EventPublisher``: a node's KV events on a ZeroMQ PUB socket, with replay.

One thread owns both sockets and the ``Residency`` tables. It drains what
the tiers reported into one batch, numbers it (``seq`` from 0, +1 per batch)
and publishes ``(topic, seq, payload)`` (``kvtier.events.wire``); it also
keeps the last ``buffer_batches`` batches. With nothing to say it still
publishes an empty batch every ``heartbeat_s``, so a subscriber can tell a
quiet node from a dead stream.

The thread sleeps until there is something to do: a report (the
``Residency.on_report`` hook writes a byte to a pipe, only while the thread
sleeps with nothing logged, so a busy node pays no system call per report),
a replay request, the next heartbeat, or ``close()``. After a batch it waits
``interval_s`` before draining again, so reports that come close together
share a batch. A node at rest wakes once per ``heartbeat_s``.

The replay socket (ROUTER) speaks vLLM's protocol: a request is
``[b"", start_seq as 8 bytes]`` (a REQ socket's envelope, or a DEALER's that
adds the empty frame); the answer is one ``[b"", topic, seq, payload]`` per
buffered batch from ``start_seq`` on, then the end marker
``[b"", b"", seq -1, b""]``. kvtier adds one thing: when ``start_seq`` is
older than the buffer, the answer starts with a snapshot batch (``Residency.snapshot``:
clear, then everything held now), numbered one before the oldest buffered
batch, so a subscriber that started late or missed more than the buffer
still converges to exactly what the node holds.

Batch 0 of every run starts with ``AllBlocksCleared``: a restarted server
announces that everything its predecessor held is gone, then what its
persistent tiers still hold (reported to ``residency`` before ``start``).
Every batch, snapshots included, carries the run's ``epoch`` (random, drawn
here): a subscriber that missed batch 0 still tells the new run from the old
one, however short either ran.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvtier.counters import Counters
from kvtier.events.residency import Residency
from kvtier.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    Event,
    EventBatch,
    encode_batch,
    seq_bytes,
    seq_of,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsConfig:
    """``[events]`` of ``kvtier serve``: off unless ``endpoint`` is set."""

    endpoint: str = ""  # PUB, e.g. tcp://127.0.0.1:5557 (bound)
    replay_endpoint: str = ""  # ROUTER for replay, e.g. tcp://127.0.0.1:5558; "" -> none
    topic: str = ""
    buffer_batches: int = 10_000
    interval_s: float = 0.005
    heartbeat_s: float = 1.0
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for name in ("buffer_batches", "hwm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"option 'events.{name}' must be positive")
        if not 0 < self.interval_s <= self.heartbeat_s:
            raise ValueError(
                "options must satisfy 0 < events.interval_s <= events.heartbeat_s, got "
                f"{self.interval_s} and {self.heartbeat_s}"
            )
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("option 'events.replay_endpoint' needs 'events.endpoint'")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


class EventPublisher:
    """See the module docstring. ``residency`` is filled by the tiers;
    ``close()`` publishes what is still logged, then stops. ``context``: the
    ZeroMQ context for the sockets (the server shares its own, so the process
    runs one pair of libzmq threads); None: the process-wide instance."""

    def __init__(
        self,
        config: EventsConfig,
        residency: Residency,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.config = config
        self.residency = residency
        self.counters = Counters()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._next_seq = 0
        self.epoch = secrets.randbits(63)  # this run's, in every batch (wire.EventBatch.epoch)
        self._first: list[Event] = [AllBlocksCleared()]
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a whole buffer (and a snapshot) per request, never dropped at the HWM
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_batches + 2)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"events: cannot bind {config.endpoint!r} / {config.replay_endpoint!r} ({exc}); "
                "set events.endpoint and events.replay_endpoint to free addresses"
            ) from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._chunk_counts: dict[str, int] = {}  # tier -> chunks, as of the last batch
        # The thread sleeps on this pipe too: a report (while ``_armed``) or close() writes.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._armed = False  # the thread sleeps with nothing logged: a report wakes it
        self._wake_lock = threading.Lock()  # no byte for a closed (or reused) pipe
        self._closed = False

    def start(self) -> None:
        self.residency.on_report = self._reported
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.residency.on_report = None
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
        self._close_sockets()

    def status(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "epoch": self.epoch,
            "next_seq": self._next_seq,
            "buffered": len(self._buffer),
            "pending_reports": self.residency.pending(),
            "chunks": self._chunk_counts,
            **self.counters.snapshot(),
        }

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        last = 0.0
        while True:
            stopping = self._stop.is_set()
            try:
                events = self._first + self.residency.drain()
                self._first = []
                now = time.monotonic()
                if events or now - last >= self.config.heartbeat_s:
                    self._publish(events)
                    last = now
                if events:  # the tables are this thread's: status() reads this copy
                    self._chunk_counts = {
                        t.name: self.residency.chunks(t) for t in self.residency.tiers()
                    }
                if stopping:
                    return
                self._sleep(poller, bool(events), last)
            except Exception:
                self.counters.add("errors", 1)
                log.exception("events: publishing failed; going on")
                self._stop.wait(self.config.interval_s)
                if stopping:
                    return

    def _sleep(self, poller: zmq.Poller, busy: bool, last: float) -> None:
        """Until the next heartbeat, a replay request or close(); and, when
        not ``busy`` (the last drain found nothing), a report. A busy thread
        gathers reports for ``interval_s`` before it drains again."""
        timeout = max(0.0, last + self.config.heartbeat_s - time.monotonic())
        if busy:
            timeout = min(timeout, self.config.interval_s)
        else:
            self._armed = True  # from now on a report writes to the pipe
            if self.residency.pending():  # one came before the flag was up
                self._armed = False
                return
        try:
            for sock, _ in poller.poll(math.ceil(timeout * 1000)):
                if sock is self._replay:
                    self._serve_replay()
        finally:
            self._armed = False
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_read, 4096):
                    pass

    def _reported(self) -> None:
        """``Residency.on_report``, on a tier's thread: wake the thread if it sleeps."""
        if self._armed:
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: it is awake
            if not self._closed:
                self._armed = False  # one byte per sleep is enough
                os.write(self._wake_write, b"\0")

    def _publish(self, events: list[Event]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(EventBatch(time.time(), events, epoch=self.epoch))
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.counters.add("dropped_batches", 1)  # no subscriber reads: replay has it
        self.counters.add("batches", 1)
        self.counters.add("events", len(events))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            self.counters.add("bad_replay_requests", 1)
            return
        peer = frames[0]
        try:
            start = seq_of(frames[2])
        except ValueError:
            self.counters.add("bad_replay_requests", 1)
            return
        self.counters.add("replays", 1)
        send = self._replay.send_multipart
        oldest = self._buffer[0][0] if self._buffer else self._next_seq
        if start < oldest:
            snapshot = encode_batch(
                EventBatch(time.time(), self.residency.snapshot(), epoch=self.epoch)
            )
            send((peer, b"", self._topic, seq_bytes(oldest - 1), snapshot))
            self.counters.add("snapshots", 1)
        for seq, payload in self._buffer:
            if seq >= start:
                send((peer, b"", self._topic, seq_bytes(seq), payload))
        send((peer, b"", b"", seq_bytes(END_SEQ), b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


__all__ = ["EventPublisher", "EventsConfig"]
