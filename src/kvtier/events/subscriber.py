"""``EventSubscriber``: follow one KV-event publisher, in order, without holes.

It reads any publisher of vLLM's KV-event format (a vLLM engine started with
``--kv-events-config``, or ``kvtier serve`` with ``[events]``) and hands
every batch, decoded (``kvtier.events.wire.decode_batch``: map or positional
events), to ``on_batch`` in sequence order, on its own thread.

- It starts by asking the replay socket for everything from batch 0, so a
  subscriber that starts late catches up (with kvtier's publisher, a
  snapshot covers what the buffer no longer holds).
- A message is a batch only once it decodes in full; one that does not (bad
  frames, a payload that does not decode) is counted (``malformed``) and
  skipped without taking its sequence number, so the publisher's batch of
  that number still applies.
- A gap in the sequence (a message lost, a slow reader) holds live batches
  back, replays from the first missing one, then goes on from the held ones.
  A held batch whose gap a replay asked *after it arrived* did not fill is
  none of the publisher's (its buffer would have had it: another process's
  message on a bound endpoint, say): it is dropped and counted
  (``unfilled_gaps``). So one message costs at most two replays, whatever
  sequence number it carries.
- A new run of the publisher: kvtier's publisher stamps every batch with its
  run's ``epoch``, so a batch of another epoch than the last one applied is
  a restart however short either run was, and a later batch of an epoch
  already left behind is stale (dropped, ``stale_batches``). vLLM sends no
  epoch: there a sequence number that goes backwards (beyond the duplicate a
  replay races) is a restart. On a restart the subscriber hands on an
  ``AllBlocksCleared`` and replays from 0 (the new run's batches come back in
  that replay).
- After ``IDLE_REPLAY_S`` of silence it asks for a replay from the next
  batch it expects: a lost *last* batch is found too (vLLM sends no
  heartbeats, so no later batch would show the gap).
- Without a replay endpoint, or when a replay does not end within
  ``replay_timeout_s``, or when the publisher's buffer no longer reaches
  back to the gap, the missing batches are counted as ``lost_batches`` and
  it goes on: what they said stays unknown, which may cost a miss.
- A bound subscriber (any process may connect to it) refuses a live message
  part larger than ``MAX_MESSAGE_BYTES``: ZeroMQ drops the connection
  unread and the sender connects again. A connecting subscriber has no such
  limit (its peer is the publisher it was given, and ZeroMQ would not
  connect again after such a refusal).

``resync()`` (any thread) does what a restart does; a router calls it when a
node's boot id changes (a restart with no batch of the new run seen yet).

vLLM binds its PUB socket only for a wildcard or ipc endpoint (``tcp://*:5557``)
and otherwise *connects* it; ``bind=True`` is for that case: the subscriber
binds the endpoint (say ``tcp://127.0.0.1:5557``) and the engine connects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvtier.counters import Counters
from kvtier.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    DecodedBatch,
    decode_batch,
    seq_bytes,
    seq_of,
)

log = logging.getLogger(__name__)
POLL_MS = 50
BURST = 1000  # messages read from one socket before the other gets a turn
IDLE_REPLAY_S = 2.0  # silent this long: ask for a replay from the next expected batch
MAX_MESSAGE_BYTES = 1 << 28  # per live message part, when bound; vLLM's batches are far smaller
RETIRED_EPOCHS = 8  # runs left behind whose late batches are recognised as stale
_END = seq_bytes(END_SEQ)


@dataclass(frozen=True, slots=True)
class _Held:
    """A decoded batch kept back while a replay runs; ``asks``: how many
    replays had been asked for when it arrived."""

    seq: int
    batch: DecodedBatch
    asks: int


class EventSubscriber:
    """See the module docstring. Every field below is the subscriber thread's,
    except ``_resync`` and ``_stop`` (set from any thread) and what
    ``status()`` reads (one field at a time, a snapshot only)."""

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
        self._epoch: int | None = None  # the publisher run of the last applied batch
        self._retired: deque[int] = deque(maxlen=RETIRED_EPOCHS)  # runs left behind
        self._runs = 0  # restarts handled, so a loop over held batches sees one happen
        self._replay_since: float | None = None  # when the replay in flight was asked for
        self._held: list[_Held] = []  # live batches that came during a replay
        self._replay: zmq.Socket[bytes] | None = None  # the thread's; a new one per abandoned ask
        self._asked = 0.0  # when the last replay was asked for
        self._asks = 0  # replays asked for so far
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
        """Handle a restart the batches could not show (a router calls this
        when a node's boot id changes): clear and replay from 0."""
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
            "epoch": self._epoch,
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
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
            self._ask_replay(0)
        except zmq.ZMQError as exc:
            log.error(
                "events %s: cannot %s %s / connect %s (%s)",
                self.name,
                "bind" if self.bind else "connect",
                self.endpoint,
                self.replay_endpoint,
                exc,
            )
            self.counters.add("errors", 1)
            self._close(sub)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    if self._resync.is_set():
                        self._resync.clear()
                        self._restart()
                    self._step(sub)
                except Exception:  # one bad step must not end the stream for good
                    log.exception("events %s: a step failed; going on", self.name)
                    self.counters.add("errors", 1)
                    self._stop.wait(POLL_MS / 1000)
        finally:
            self._close(sub)

    def _close(self, sub: zmq.Socket[bytes]) -> None:
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
        if replay is not None and replay in ready:
            for _ in range(BURST):
                if replay is not self._replay:
                    break  # abandoned (closed) by a restart or a given-up replay
                try:
                    frames = replay.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_replay(frames)
        if sub in ready:
            for _ in range(BURST):
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
        read = self._read(frames)
        if read is None:
            return
        held = _Held(read[0], read[1], self._asks)
        if self._replay_since is not None:
            self._held.append(held)
        else:
            self._take(held)

    def _take(self, held: _Held) -> None:
        """A live batch, in or out of order, while no replay is in flight."""
        seq, batch = held.seq, held.batch
        if self._stale(batch):
            return
        if self._new_run(batch):
            self._restart_at(held, f"epoch {self._epoch} became {batch.epoch}")
            return
        expected = self._expected
        if expected is None or seq == expected:
            self._apply(seq, batch)
        elif seq > expected:
            self._gap(held, expected)
        elif seq < expected - 1 and self._epoch is None:
            # No epoch to tell a new run by (vLLM): a sequence that goes back is one.
            self._restart_at(held, f"sequence went back from {expected} to {seq}")
        else:
            self.counters.add("duplicates", 1)  # a replay raced it (or its epoch says so)

    def _gap(self, held: _Held, expected: int) -> None:
        if not self.replay_endpoint:
            self.counters.add("lost_batches", held.seq - expected)
            self._apply(held.seq, held.batch)
        elif held.asks < self._asks:
            # A replay asked for after this batch arrived ended short of it: the
            # publisher's buffer does not know it, so it is not the publisher's.
            self.counters.add("unfilled_gaps", 1)
            log.warning(
                "events %s: batch %d is past what the publisher replays (%d); dropped",
                self.name,
                held.seq,
                expected,
            )
        else:
            self.counters.add("gaps", 1)
            self._held.append(held)
            self._ask_replay(expected)

    def _stale(self, batch: DecodedBatch) -> bool:
        """A batch of a run already left behind, arriving late: dropped."""
        if batch.epoch is None or batch.epoch not in self._retired:
            return False
        self.counters.add("stale_batches", 1)
        return True

    def _new_run(self, batch: DecodedBatch) -> bool:
        return self._epoch is not None and batch.epoch != self._epoch

    def _restart_at(self, held: _Held, why: str) -> None:
        """``held`` is the first batch seen of the publisher's new run."""
        self.counters.add("restarts", 1)
        log.info("events %s: the publisher restarted (%s)", self.name, why)
        old = self._epoch
        if old is not None and held.batch.epoch != old:
            self._retired.append(old)  # its late batches are stale from now on
        self._restart()
        if not self.replay_endpoint:  # else the replay from 0 brings it back
            self._take(held)

    def _restart(self) -> None:
        """Forget the old run: hand on a clear, then sync from batch 0."""
        self._runs += 1
        self._epoch = None
        self._expected = None
        self._held = []  # the old run's, or the new run's that the replay brings again
        self._deliver(DecodedBatch(time.time(), [AllBlocksCleared()], None, 0))
        self._ask_replay(0)

    def _ask_replay(self, start: int) -> None:
        if not self.replay_endpoint:
            return
        if self._replay is None or self._replay_since is not None:
            self._new_replay_socket()  # answers to an abandoned request must not arrive
        assert self._replay is not None
        self._replay.send_multipart((b"", seq_bytes(start)))
        self._replay_since = self._asked = time.monotonic()
        self._expected = start
        self._asks += 1
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
        if len(frames) == 4 and frames[0] == b"" and frames[2] == _END:
            self._end_replay(gave_up=False)
            return
        if frames[0] != b"":
            self._malformed("a replayed message without its empty envelope frame")
            return
        read = self._read(frames[1:])
        if read is None:
            return
        seq, batch = read
        self.counters.add("replayed_batches", 1)
        if self._stale(batch):
            return
        if self._new_run(batch):  # it restarted since the last batch applied
            self._restart_at(_Held(seq, batch, self._asks), f"epoch {batch.epoch} in a replay")
            return
        expected = self._expected
        if expected is None or seq < expected:
            return
        if seq > expected and not _starts_cleared(batch):
            # The publisher's buffer no longer reaches back to ``expected``.
            self.counters.add("lost_batches", seq - expected)
        self._apply(seq, batch)

    def _end_replay(self, *, gave_up: bool) -> None:
        """Go on from the batches held during the replay; when it was given up
        on, what it should have brought is lost."""
        self._replay_since = None
        if gave_up:
            self._new_replay_socket()
        held, self._held = sorted(self._held, key=lambda item: item.seq), []
        runs = self._runs
        for index, item in enumerate(held):
            expected = self._expected
            if expected is not None and item.seq < expected and not self._new_run(item.batch):
                continue  # the replay brought it too
            if gave_up and expected is not None and item.seq > expected:
                self.counters.add("lost_batches", item.seq - expected)
                self._expected = item.seq
            self._take(item)
            if self._replay_since is not None:  # another replay: hold the rest again
                if self._runs == runs:  # (after a restart, the replay from 0 brings them)
                    self._held.extend(held[index + 1 :])
                break

    def _read(self, frames: list[bytes]) -> tuple[int, DecodedBatch] | None:
        """The sequence number and decoded batch of ``[topic, seq, payload]``;
        None, counted as malformed, for anything else."""
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, not 3")
            seq = seq_of(frames[1])
            batch = decode_batch(frames[2])
        except ValueError as exc:  # msgspec's decode and validation errors included
            self._malformed(str(exc))
            return None
        if batch.skipped:
            self.counters.add("unknown_events", batch.skipped)
        return seq, batch

    def _malformed(self, why: str) -> None:
        self.counters.add("malformed", 1)
        log.warning("events %s: a message that is no batch (%s); skipped", self.name, why)

    def _apply(self, seq: int, batch: DecodedBatch) -> None:
        self._expected = seq + 1
        self._epoch = batch.epoch
        self.counters.add("batches", 1)
        self._deliver(batch)

    def _deliver(self, batch: DecodedBatch) -> None:
        try:
            self._on_batch(batch)
        except Exception:
            self.counters.add("apply_errors", 1)
            log.exception("events %s: applying a batch failed", self.name)


def _starts_cleared(batch: DecodedBatch) -> bool:
    """Whether the batch begins by clearing everything (a restart's first
    batch, kvtier's snapshot): then no batch before it matters."""
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)


__all__ = ["EventSubscriber"]
