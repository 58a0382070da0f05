"""``kvtier serve``: one cache server process per node.

The server's loop (``ServerTransport.serve``, on the main thread) is its one
clock: besides requests it watches stdin (``--stop-with-stdin``) and the
admin port's listening socket, and runs the periodic upkeep. At rest the
process holds the loop, the store and prefetch controllers' threads, the
KV event publisher's (when events are on) and libzmq's two. The server does
no BLAS: ``kvtier serve`` sets ``OPENBLAS_NUM_THREADS=1`` (unless it is set)
before numpy loads, so OpenBLAS starts no pool of a thread per core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import zmq

from kvtier.events.publisher import EventPublisher
from kvtier.events.residency import Residency
from kvtier.l2.registry import parse_spec
from kvtier.operations.admin import AdminHTTP
from kvtier.server.config import ServerConfig
from kvtier.server.core import CacheServer
from kvtier.server.transport import ServerTransport
from kvtier.storage import StorageConfig, StorageManager
from kvtier.tenancy.tenants import TenantTable
from kvtier.tenancy.usage import L2Usage
from kvtier.units import format_size

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 1 << 20  # bytes stores at least this large are copied off the loop thread
PURGE_STATE = "purges.json"  # next to the fs L2's objects: unfinished purges resume


def storage_config(config: ServerConfig) -> StorageConfig:
    local = () if config.l2_dir is None else ({"type": "fs", "path": config.l2_dir},)
    l2 = (*local, *(parse_spec(spec) for spec in config.l2))  # the local disk first
    l1 = dataclasses.replace(config.l1, reaper=True)  # a killed server leaves no arena
    return StorageConfig(
        l1=l1, l2=l2, store=config.store, prefetch=config.prefetch, seal=config.sealer
    )


def tenant_table(config: ServerConfig) -> TenantTable:
    """The tenants file's, else the single ``--auth-token`` as one tenant."""
    if config.tenants_file:
        return TenantTable.from_file(config.tenants_file)
    return TenantTable.single(config.auth_token)


def stop_at_end_of(transport: ServerTransport, fd: int, stop: threading.Event) -> None:
    """Set ``stop`` once the pipe ``fd`` ends: the loop reads and drops what
    comes (unbuffered, whenever it is readable); at its end a parent that
    started the server with a pipe on its stdin has closed it or exited,
    however it died, and the server stops as on SIGTERM."""

    def readable() -> None:
        if os.read(fd, 4096):
            return
        log.info("kvtier serve: stdin closed; stopping")
        transport.unwatch(fd)
        stop.set()

    transport.watch(fd, readable)


def serve(
    config: ServerConfig, stop: threading.Event | None = None, *, stop_with_stdin: bool = False
) -> None:
    """Run until ``stop`` is set, SIGTERM or SIGINT (or, with
    ``stop_with_stdin``, stdin ends); release everything on the way out.
    ``stop`` set by another thread is seen within a tick
    (``kvtier.server.transport.TICK_S``)."""
    stop = stop or threading.Event()
    transport: ServerTransport | None = None
    if threading.current_thread() is threading.main_thread():  # before the slow start-up

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()
            if transport is not None:
                transport.wake()  # the loop may sleep until its next tick

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    residency = Residency(config.chunk_size) if config.events.enabled else None
    tenants = tenant_table(config)
    # Its gate keeps the tenants' caps on shared stores.
    usage = L2Usage(tenants, rows_per_tenant=config.limits.max_namespace_rows)
    storage = StorageManager(
        storage_config(config),
        residency,
        owners=tenants.owners(),
        store_gate=usage.gate,
        on_stored=usage.on_stored,
    )
    core = CacheServer(
        storage,
        config.chunk_size,
        tenants,
        config.limits,
        offload_bytes=OFFLOAD_BYTES,
        purge_state=Path(config.l2_dir) / PURGE_STATE if config.l2_dir else None,
        purge=config.purge,
        default_prefill_s_per_token=config.ledger_prefill_s_per_token or None,
        l2_usage=usage,
    )
    # One ZeroMQ context for the RPC socket and the KV events: one pair of libzmq threads.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    admin = None
    publisher = None
    try:
        if residency is not None:
            publisher = EventPublisher(config.events, residency, context)
            core.publisher_status = publisher.status
            publisher.start()
        transport = ServerTransport(core, f"tcp://{config.host}:{config.port}", context=context)
        if stop_with_stdin:
            stop_at_end_of(transport, sys.stdin.fileno(), stop)
        if config.http_port >= 0:
            admin = AdminHTTP(transport, config.host, config.http_port)
        http = f"http://{config.host}:{admin.port}" if admin else "off"
        l2 = config.l2_dir or "none"
        events = "off"
        if publisher is not None:
            events = f"{publisher.endpoint} replay {publisher.replay_endpoint or 'none'}"
        print(
            f"kvtier serve: rpc {transport.address} http {http} boot {core.boot_id} "
            f"l1 {format_size(config.l1.size_bytes)} arena {storage.arena_name} l2 {l2} "
            f"events {events}",
            flush=True,
        )
        transport.serve(stop)
    finally:
        if admin is not None:
            admin.close()
        core.close()
        storage.close()
        if publisher is not None:
            publisher.close()
        context.destroy(linger=0)  # closes what a failed start left open, then ends the context
