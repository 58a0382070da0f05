"""Serve an aiohttp application until SIGTERM or SIGINT: ``kvtier route``'s
and ``kvtier pd-proxy``'s loop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from aiohttp import web


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    ready_line: Callable[[int], str],
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or a signal, on the main thread); print
    ``ready_line(bound port)`` once listening."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            break
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        print(ready_line(runner.addresses[0][1]), flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
