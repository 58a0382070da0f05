"""``kvtier route``'s command line (the router itself is imported when it runs:
it needs the ``route`` extra)."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.extras import missing_extra
from kvtier.router.scoring import POLICIES


def _run(args: argparse.Namespace) -> int:
    try:
        from kvtier.router.main import run
    except ImportError as exc:
        return missing_extra("route", exc, '"kvtier[route]"')
    return run(args)


def _run_pd(args: argparse.Namespace) -> int:
    try:
        from kvtier.router.pd.proxy import run
    except ImportError as exc:
        return missing_extra("route", exc, '"kvtier[route]"')
    return run(args)


def add_parser(commands: Any) -> None:
    route = commands.add_parser(
        "route",
        help="run the gateway and cache-aware router in front of several engines",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /status) that authenticates tenants, rate-limits them, "
        "sets their cache salt and sends each request to the engine with the least expected "
        "time to first token. Engines, tenants and costs go in the --config TOML file "
        "([[engines]], [[tenants]], [cost]); KVTIER_ROUTE_<OPTION> variables and flags override "
        "the top-level options.",
    )
    route.add_argument("--config", help="TOML file with engines, tenants and options")
    route.add_argument("--host", help="bind address (default 127.0.0.1)")
    route.add_argument("--port", type=int, help="HTTP port (default 8000; 0 picks one)")
    route.add_argument("--policy", choices=sorted(POLICIES), help="routing policy (kvtier)")
    route.add_argument("--model", help="the model name clients use (default: the engines')")
    route.add_argument(
        "--tokenizer", help="a local tokenizer directory (default: engine /tokenize)"
    )
    route.add_argument(
        "--engine",
        action="append",
        metavar="URL|JSON",
        help="an engine: its URL, or a JSON object of [[engines]] options (repeatable)",
    )
    route.set_defaults(run=_run)
    pd = commands.add_parser(
        "pd-proxy",
        help="serve completions by prefill on one engine and decode on another",
        description="An OpenAI-compatible /v1/completions that prefills each prompt on a "
        "--prefill engine (one token), hands its KV to a --decode engine through the kvtier "
        "cache server and streams the decode's tokens after the first. Both engines run the "
        "kvtier connector (docs/disaggregation.md).",
    )
    pd.add_argument("--prefill", action="append", metavar="URL", help="a prefill engine")
    pd.add_argument("--decode", action="append", metavar="URL", help="a decode engine")
    pd.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    pd.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks)")
    pd.add_argument(
        "--on-failure",
        choices=("recompute", "error"),
        default="recompute",
        help="a failed hand-off: recompute on the decode engine, or answer an error "
        "(a request's kvtier_on_failure field overrides it)",
    )
    pd.add_argument(
        "--timeout-s", type=float, default=600.0, help="one engine request's limit (600)"
    )
    pd.add_argument(
        "--cache-admin",
        metavar="URL",
        help="the cache server's admin port, asked what became of a failed hand-off (its "
        "token from KVTIER_AUTH_TOKEN)",
    )
    pd.set_defaults(run=_run_pd)


__all__ = ["add_parser"]
