"""``redis``: objects in Redis or Valkey (one server, or a cluster), through
redis-py (hiredis parses replies when installed).

- One value per object under ``{key_prefix}{ObjectKey.to_str()}``: the model
  and the tenant salt are in every key, so tenants and models sharing one
  store never meet. The value is the shared object format (header, then
  payload), checked on every load; a bad copy is a miss and is deleted.
- Batches are pipelined: one round trip per ``batch_bytes`` of values (and
  per ``batch_keys`` keys for lookups), so a large batch never holds a
  connection for long and small ones cost one round trip.
- ``ttl_s`` > 0 sets an expiry on every stored object (Redis then evicts by
  its own policy; with ``maxmemory`` set, ``allkeys-lru`` suits a cache); a
  store of an object Redis holds already renews its expiry instead.
- ``cluster``: ``RedisCluster`` with the same URL as its first node; a
  pipeline is split by slot across the nodes by redis-py.
- Connection errors and timeouts fail the whole batch (back-off, then the
  pool reconnects); a server without persistence that restarts has lost its
  objects: misses, not errors.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import redacted
from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.base import AdapterConfig, Buffer, CompletionCallback, PurgeStep
from kvtier.l2.blocking import BackendUnavailable, BlockingAdapter
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    stored_bound,
)
from kvtier.l2.stored_value import decode_object, encode_object

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisConfig(AdapterConfig):
    # A Redis shard serves one command at a time: two client threads keep it
    # busy; more only contend for the GIL and the cores (measured, BENCHMARKS.md).
    io_threads: int = 2
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvtier:"
    ttl_s: float = 0.0  # 0: objects do not expire
    max_connections: int = 32
    batch_bytes: int = 64 << 20  # values per pipeline round trip
    batch_keys: int = 512  # keys per lookup round trip

    def __post_init__(self) -> None:
        super(RedisConfig, self).__post_init__()
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"option 'url' must be a redis://, rediss:// or unix:// URL, got {self.url!r}"
            )
        if self.ttl_s < 0:
            raise ValueError(f"option 'ttl_s' must be >= 0, got {self.ttl_s}")
        for name in ("max_connections", "batch_bytes", "batch_keys"):
            if getattr(self, name) <= 0:
                raise ValueError(f"option '{name}' must be positive, got {getattr(self, name)}")


class RedisAdapter(BlockingAdapter):
    type_name = "redis"
    config_class = RedisConfig

    def __init__(self, config: RedisConfig, on_complete: CompletionCallback) -> None:
        import redis
        import redis.cluster

        super().__init__(config, on_complete)
        self.redis_config = config
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError,)
        self._timeouts: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError,)
        options: dict[str, Any] = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.timeout_s,
            "max_connections": config.max_connections,
        }
        self._client: Any = (
            redis.cluster.RedisCluster.from_url(config.url, **options)
            if config.cluster
            else redis.Redis.from_url(config.url, **options)
        )

    def name_of(self, key: ObjectKey) -> str:
        """The key of ``key``'s object in Redis."""
        return self.redis_config.key_prefix + key.to_str()

    # ----------------------------------------------------------- backend

    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        ttl_ms = int(self.redis_config.ttl_s * 1000) or None
        written: list[int | None] = []
        for part in self._parts([b.nbytes for b in buffers]):
            pipe = self._client.pipeline(transaction=False)
            sizes = []
            for i in part:
                value = encode_object(keys[i], layout, buffers[i], self.codec, self.seal)
                pipe.set(self.name_of(keys[i]), value, px=ttl_ms)
                sizes.append(len(value))
            replies = self._execute(pipe)
            for size, reply in zip(sizes, replies, strict=True):
                ok = reply is True
                if not ok:
                    self._count_failure("error")
                written.append(size if ok else None)
        return written

    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        found: list[bool] = []
        step = self.redis_config.batch_keys
        for start in range(0, len(keys), step):
            pipe = self._client.pipeline(transaction=False)
            for key in keys[start : start + step]:
                pipe.exists(self.name_of(key))
            found += [isinstance(n, int) and n > 0 for n in self._execute(pipe)]
        return found

    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        loaded: list[bool] = []
        for part in self._parts([b.nbytes for b in buffers]):
            pipe = self._client.pipeline(transaction=False)
            for i in part:  # at most one byte past the bound: a longer copy is refused
                pipe.getrange(self.name_of(keys[i]), 0, stored_bound(buffers[i].nbytes))
            for i, value in zip(part, self._execute(pipe), strict=True):
                loaded.append(self._check(keys[i], value, buffers[i], layout))
        return loaded

    def _refresh(self, keys: Sequence[ObjectKey]) -> None:
        """Objects a store found present get their TTL back, as a SET would."""
        ttl_ms = int(self.redis_config.ttl_s * 1000)
        if not ttl_ms:
            return
        step = self.redis_config.batch_keys
        for start in range(0, len(keys), step):
            pipe = self._client.pipeline(transaction=False)
            for key in keys[start : start + step]:
                pipe.pexpire(self.name_of(key), ttl_ms)
            self._execute(pipe)

    def _reconnect(self) -> None:
        try:
            self._client.ping()
        except self._errors + self._timeouts as exc:
            raise BackendUnavailable(str(exc)) from exc

    def _close_backend(self) -> None:
        self._client.close()

    def _backend_status(self) -> dict[str, object]:
        return {"url": redacted(self.redis_config.url), "cluster": self.redis_config.cluster}

    # --------------------------------------------------------- internals

    def _parts(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Indices in runs of at most ``batch_bytes`` (at least one each)."""
        part: list[int] = []
        total = 0
        for i, size in enumerate(sizes):
            if part and total + size > self.redis_config.batch_bytes:
                yield part
                part, total = [], 0
            part.append(i)
            total += size
        if part:
            yield part

    def _execute(self, pipe: Any) -> list[Any]:
        try:
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except self._timeouts as exc:
            raise TimeoutError(str(exc)) from exc
        except self._errors as exc:
            raise BackendUnavailable(str(exc)) from exc
        for reply in replies:
            if isinstance(reply, self._errors):
                raise BackendUnavailable(str(reply))
            if isinstance(reply, self._timeouts):
                raise TimeoutError(str(reply))
        return replies

    def _check(self, key: ObjectKey, value: Any, buffer: Buffer, layout: str) -> bool:
        if not value:  # GETRANGE of a missing key is empty; no copy ever is
            self._count_failure("not_found")
            return False
        if isinstance(value, Exception):
            log.warning("L2 %s: loading %s failed: %s", self.name, key, value)
            self._count_failure("error")
            return False
        try:
            if len(value) > stored_bound(buffer.nbytes):
                raise CorruptObject(Corruption.LENGTH, "longer than any copy of this object")
            decode_object(value, key, layout, buffer, self.codec, self.seal)
        except CorruptObject as error:
            self._corrupt(key, error)
            self._delete(key)
            return False
        return True

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        """SCAN + UNLINK, one SCAN step per call (a cluster: every node's keys
        in one pass of ``scan_iter``, ``limit`` at a time, until none match)."""
        pattern = self.redis_config.key_prefix + selector.glob()
        try:
            if self.redis_config.cluster:
                names = list(itertools.islice(
                    self._client.scan_iter(match=pattern, count=limit), limit
                ))  # fmt: skip
                after: str | None = "" if len(names) == limit else None
            else:
                position, names = self._client.scan(int(cursor or 0), match=pattern, count=limit)
                after = None if int(position) == 0 else str(position)
            deleted, step = 0, self.redis_config.batch_keys
            for start in range(0, len(names), step):
                deleted += int(self._client.unlink(*names[start : start + step]))
        except self._errors + self._timeouts as exc:
            raise BackendUnavailable(str(exc)) from exc
        return PurgeStep(deleted, after)

    def _delete(self, key: ObjectKey) -> None:
        try:
            self._client.delete(self.name_of(key))
        except self._errors + self._timeouts as exc:
            log.warning("L2 %s: could not delete the bad copy of %s: %s", self.name, key, exc)


class ValkeyAdapter(RedisAdapter):
    """The same adapter under the type name ``valkey`` (Valkey speaks RESP)."""

    type_name = "valkey"
