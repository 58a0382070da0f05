"""``kvtier route``: run the router until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

from kvtier.router.app import RouterService
from kvtier.router.config import RouterConfig, load_router_config
from kvtier.router.serving import serve_app


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or a signal); print the ready line first."""
    service = RouterService(config)

    def ready(port: int) -> str:
        return (
            f"kvtier route: http://{config.host}:{port} policy {config.policy} "
            f"engines {len(service.specs)} tenants {len(service.gateway.tenants)}"
        )

    await serve_app(service.app(), config.host, config.port, ready, stop)


def engine_flag(text: str, index: int) -> dict[str, Any]:
    """``--engine``: a URL, or a JSON object of ``[[engines]]`` options."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--engine {text!r} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--engine {text!r} must be a URL or a JSON object")
        value.setdefault("name", f"engine{index}")
        return value
    return {"name": f"engine{index}", "url": text}


def run(args: argparse.Namespace) -> int:
    flags: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "policy": args.policy,
        "model": args.model,
        "tokenizer": args.tokenizer,
        "engines": [engine_flag(e, i) for i, e in enumerate(args.engine)] if args.engine else None,
    }
    config = load_router_config(flags, args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(config))
    return 0


__all__ = ["engine_flag", "run", "serve"]
