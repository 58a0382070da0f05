"""``EventSubscriber``: follow one KV-event publisher, in order, without holes.

It reads any publisher of vLLM's KV-event format (a vLLM engine started with
``--kv-events-config``, or ``kvtier serve`` with ``[events]``) and hands
every batch, decoded (``kvtier.events.wire.decode_batch``: map or positional
events), to ``on_batch`` in sequence order, on its own thread.

- It starts by asking the replay socket for everything from batch 0, so a
  subscriber that starts late catches up (with kvtier's publisher, a
  snapshot covers what the buffer no longer holds).
- A gap in the sequence (a message lost, a slow reader) holds live batches
  back, replays from the first missing one, then goes on from the held ones.
- A sequence number that goes backwards means the publisher restarted: the
  subscriber hands on an ``AllBlocksCleared`` and replays from 0.
- After ``IDLE_REPLAY_S`` of silence it asks for a replay from the next
  batch it expects: a lost *last* batch is found too (vLLM sends no
  heartbeats, so no later batch would show the gap).
- Without a replay endpoint, or when a replay does not end within
  ``replay_timeout_s``, the missing batches are counted as ``lost_batches``
  and it goes on: what they said stays unknown, which may cost a miss.
- A batch that does not decode is counted (``malformed``) and skipped.

``resync()`` (any thread) does what a restart does; a router calls it when a
node's boot id changes (a restart the sequence numbers could not show).

vLLM binds its PUB socket only for a wildcard or ipc endpoint (``tcp://*:5557``)
and otherwise *connects* it; ``bind=True`` is for that case: the subscriber
binds the endpoint (say ``tcp://127.0.0.1:5557``) and the engine connects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvtier.counters import Counters
from kvtier.events.wire import END_SEQ, AllBlocksCleared, DecodedBatch, decode_batch, seq_of

log = logging.getLogger(__name__)
POLL_MS = 50
IDLE_REPLAY_S = 2.0  # silent this long: ask for a replay from the next expected batch


class EventSubscriber:
    """See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        on_batch: Callable[[DecodedBatch], None],
        *,
        topic: str = "",
        name: str = "",
        replay_timeout_s: float = 5.0,
        bind: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.bind = bind
        self.name = name or endpoint
        self.counters = Counters()
        self.last_message = 0.0  # time.monotonic() of the last message (live or replayed)
        self._on_batch = on_batch
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self._expected: int | None = None  # next sequence number to apply
        self._replay_since: float | None = None  # when the replay in flight was asked for
        self._held: list[tuple[int, bytes]] = []  # live batches that came during a replay
        self._replay: zmq.Socket[bytes] | None = None  # the thread's; a new one per abandoned ask
        self._asked = 0.0  # when the last replay was asked for
        self._resync = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name=f"events-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def resync(self) -> None:
        self._resync.set()

    @property
    def synced(self) -> bool:
        """Whether batches are applied in order now (not waiting for a replay)."""
        return self._expected is not None and self._replay_since is None

    def status(self) -> dict[str, object]:
        age = time.monotonic() - self.last_message if self.last_message else None
        return {
            "endpoint": self.endpoint,
            "next_seq": self._expected,
            "synced": self.synced,
            "last_message_age_s": age,
            **self.counters.snapshot(),
        }

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            log.error(
                "events %s: cannot %s %s (%s)",
                self.name,
                "bind" if self.bind else "connect",
                self.endpoint,
                exc,
            )
            self.counters.add("errors", 1)
            sub.close(linger=0)
            self._ready.set()
            return
        try:
            self._ask_replay(0)
            self._ready.set()
            while not self._stop.is_set():
                if self._resync.is_set():
                    self._resync.clear()
                    self._restart()
                self._step(sub)
        except Exception:
            log.exception("events %s: subscriber failed", self.name)
            self.counters.add("errors", 1)
        finally:
            self._ready.set()
            sub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _step(self, sub: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        replay = self._replay
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        ready = dict(poller.poll(POLL_MS))
        if replay is not None and replay in ready and replay is self._replay:
            self._on_replay(replay.recv_multipart())
        if sub in ready:
            for _ in range(1000):  # then the replay socket gets a turn
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_live(frames)
        now = time.monotonic()
        since = self._replay_since
        if since is not None and now - since > self._replay_timeout_s:
            self.counters.add("replay_timeouts", 1)
            log.warning("events %s: replay did not end; going on", self.name)
            self._end_replay(gave_up=True)
        elif (
            since is None
            and self.replay_endpoint
            and now - max(self.last_message, self._asked) > IDLE_REPLAY_S
        ):
            # Silence: ask whether anything was missed (vLLM sends no heartbeats, so a
            # lost last batch would otherwise stay unknown until the next one).
            self.counters.add("idle_replays", 1)
            self._ask_replay(self._expected or 0)

    def _on_live(self, frames: list[bytes]) -> None:
        self.last_message = time.monotonic()
        seq = self._sequence(frames, 3, 1)
        if seq is None:
            return
        if self._replay_since is not None:
            self._held.append((seq, frames[2]))
        else:
            self._take(seq, frames[2])

    def _take(self, seq: int, payload: bytes) -> None:
        """A live batch, in or out of order."""
        expected = self._expected
        if expected is None or seq == expected:
            self._apply(seq, payload)
        elif seq > expected:
            self.counters.add("gaps", 1)
            if self.replay_endpoint:
                self._held.append((seq, payload))
                self._ask_replay(expected)
            else:
                self.counters.add("lost_batches", seq - expected)
                self._apply(seq, payload)
        elif seq < expected - 1:  # expected - 1: a duplicate that a replay raced
            self.counters.add("restarts", 1)
            log.info("events %s: sequence went back from %d to %d", self.name, expected, seq)
            self._held.append((seq, payload))
            self._restart()

    def _restart(self) -> None:
        self._deliver(DecodedBatch(time.time(), [AllBlocksCleared()], None, 0))
        if self.replay_endpoint:
            self._ask_replay(0)
            return
        self._expected = None
        held, self._held = self._held, []
        for seq, payload in held:
            self._take(seq, payload)

    def _ask_replay(self, start: int) -> None:
        if not self.replay_endpoint:
            return
        if self._replay is None or self._replay_since is not None:
            self._new_replay_socket()  # answers to an abandoned request must not arrive
        assert self._replay is not None
        self._replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        self._replay_since = self._asked = time.monotonic()
        self._expected = start
        self.counters.add("replays", 1)

    def _new_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.RCVHWM, 0)
        self._replay.connect(self.replay_endpoint)

    def _on_replay(self, frames: list[bytes]) -> None:
        self.last_message = time.monotonic()
        if self._replay_since is None:
            return  # left over from a request given up on
        seq = self._sequence(frames, 4, 2) if frames[0] == b"" else None
        if seq is None:
            if frames[0] != b"":
                self.counters.add("malformed", 1)
            return
        if seq == END_SEQ:
            self._end_replay(gave_up=False)
            return
        self.counters.add("replayed_batches", 1)
        if self._expected is not None and seq >= self._expected:
            self._apply(seq, frames[3])

    def _end_replay(self, *, gave_up: bool) -> None:
        """Go on from the batches held during the replay; when it was given up
        on, what it should have brought is lost."""
        self._replay_since = None
        if gave_up:
            self._new_replay_socket()
        held, self._held = sorted(self._held, key=lambda item: item[0]), []
        for index, (seq, payload) in enumerate(held):
            expected = self._expected
            if expected is not None and seq < expected:
                continue
            if gave_up and expected is not None and seq > expected:
                self.counters.add("lost_batches", seq - expected)
                self._expected = seq
            self._take(seq, payload)
            if self._replay_since is not None:  # another gap: hold the rest again
                self._held.extend(held[index + 1 :])
                break

    def _sequence(self, frames: list[bytes], count: int, at: int) -> int | None:
        """The sequence number of a message of ``count`` frames; None (counted
        as malformed) for any other shape."""
        try:
            if len(frames) != count:
                raise ValueError(f"{len(frames)} frames")
            return seq_of(frames[at])
        except ValueError:
            self.counters.add("malformed", 1)
            return None

    def _apply(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.counters.add("malformed", 1)
            log.warning("events %s: batch %d does not decode (%s); skipped", self.name, seq, exc)
            return
        if batch.skipped:
            self.counters.add("unknown_events", batch.skipped)
        self.counters.add("batches", 1)
        self._deliver(batch)

    def _deliver(self, batch: DecodedBatch) -> None:
        try:
            self._on_batch(batch)
        except Exception:
            self.counters.add("apply_errors", 1)
            log.exception("events %s: applying a batch failed", self.name)


__all__ = ["EventSubscriber"]
