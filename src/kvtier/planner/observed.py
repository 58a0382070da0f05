"""A plan's inputs as a running cache server sees them (``kvtier plan --from-server``).

``/status`` (a ``ServerStatus``) gives the chunk size and the layouts
engines registered; its counters read twice ``sample_s`` apart (or once,
over the server's whole uptime, with ``sample_s=0``) give the request rate,
the tokens looked up per request, the share served from L2 and the tokens
stored. Every counter is server-wide: with several models on one server the
traffic is theirs together.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.planner.shape import DTYPES
from kvtier.protocol.status import RegisteredLayout, ServerCounts, ServerStatus, decode

_SHAPE_DTYPES = {layout: flag for flag, layout in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Observation:
    """Counter deltas over ``window_s`` seconds, and the planned namespace's layout."""

    url: str
    namespace: str
    layout: dict[str, Any]  # KVLayout fields of group 0, per rank
    groups: int
    chunk_size: int
    window_s: float
    lookups: float
    lookup_tokens: float
    hit_tokens: dict[str, float]  # by tier
    stored_objects: float

    @property
    def qps(self) -> float:
        return self.lookups / self.window_s

    @property
    def prefix_tokens(self) -> int:
        return int(self.lookup_tokens // self.lookups)

    @property
    def l2_hit_fraction(self) -> float:
        """Looked-up tokens served from a tier below L1 (those cross the network
        when L2 is shared)."""
        l2 = sum(tokens for tier, tokens in self.hit_tokens.items() if tier != "L1")
        return min(1.0, l2 / self.lookup_tokens)

    @property
    def stored_tokens(self) -> float:
        objects_per_chunk = int(self.layout["num_ranks"]) * self.groups
        return self.stored_objects / objects_per_chunk * self.chunk_size

    def shape_fields(self) -> dict[str, Any]:
        """``ModelShape`` fields of the layout. The server sees per-rank layouts,
        so heads are per-rank heads times ranks (TP replication, if any, is
        invisible here: ``--kv-heads`` corrects it)."""
        layout = self.layout
        dtype = _SHAPE_DTYPES.get(layout["dtype"])
        if dtype is None:
            raise ValueError(
                f"--from-server: KV dtype {layout['dtype']!r} is not one kvtier plan sizes; "
                "pass the shape with flags"
            )
        fields: dict[str, Any] = {"layers": layout["num_layers"], "dtype": dtype}
        if layout["kind"] == "latent":
            return {**fields, "mla_latent_dim": layout["head_dim"]}
        kv_heads = layout["kv_heads"] * layout["num_ranks"]
        return {**fields, "kv_heads": kv_heads, "head_dim": layout["head_dim"]}

    def deployment_fields(self) -> dict[str, Any]:
        return {"tp": self.layout["num_ranks"], "chunk_size": self.chunk_size}

    def workload_fields(self) -> dict[str, Any]:
        return {
            "qps": self.qps,
            "prefix_tokens": self.prefix_tokens,
            "read_fraction": self.l2_hit_fraction,
            "write_fraction": min(1.0, self.stored_tokens / self.lookup_tokens),
        }


def _get(url: str, token: str) -> bytes:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        hint = " (pass --auth-token-file or set KVTIER_AUTH_TOKEN)" if exc.code == 401 else ""
        raise ValueError(f"--from-server {url}: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"--from-server {url}: cannot reach it ({reason})") from None


def read_status(base: str, token: str = "") -> ServerStatus:
    """The server's ``/status``; ValueError naming the field that does not fit."""
    try:
        return decode(_get(f"{base}/status", token))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"--from-server {base}: /status is not a kvtier status ({exc})") from None


def _pick_namespace(layouts: dict[str, Any], namespace: str | None, url: str) -> str:
    if namespace is not None:
        if namespace not in layouts:
            raise ValueError(
                f"--namespace {namespace!r} has not connected to {url}; "
                f"it has seen {sorted(layouts) or 'none'}"
            )
        return namespace
    if not layouts:
        raise ValueError(
            f"--from-server {url}: no engine has connected yet, so the KV layout is "
            "unknown; connect one or pass the shape with flags"
        )
    if len(layouts) > 1:
        raise ValueError(
            f"--from-server {url} has seen several namespaces; pick one with --namespace "
            f"({', '.join(sorted(layouts))})"
        )
    return next(iter(layouts))


def observe(
    url: str,
    token: str = "",
    sample_s: float = 10.0,
    namespace: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Observation:
    """Read the server at ``url`` (its admin HTTP base, e.g. http://127.0.0.1:8765)."""
    base = url.rstrip("/")
    status = read_status(base, token)
    layouts = status.layouts
    chosen = _pick_namespace(layouts, namespace, url)
    before, began = ServerCounts(), 0.0  # sample_s 0: since the server started
    if sample_s > 0:
        before, began = status.server, status.uptime_s
        sleep(sample_s)
        status = read_status(base, token)
    after, window = status.server, status.uptime_s - began
    lookups = after.lookups - before.lookups
    lookup_tokens = after.lookup_tokens - before.lookup_tokens
    if window <= 0 or lookups <= 0 or lookup_tokens <= 0:
        span = f"the last {sample_s:g} s" if sample_s > 0 else "its uptime"
        raise ValueError(
            f"--from-server {url}: no lookups in {span}; send traffic, or use a longer "
            "--sample-s (0: since the server started)"
        )
    hits = {tier: float(n - before.hit_tokens.get(tier, 0)) for tier, n in after.hit_tokens.items()}
    first: RegisteredLayout = layouts[chosen][min(layouts[chosen], key=int)]
    return Observation(
        url=url,
        namespace=chosen,
        layout=msgspec.structs.asdict(first),
        groups=len(layouts[chosen]),
        chunk_size=status.chunk_size,
        window_s=window,
        lookups=float(lookups),
        lookup_tokens=float(lookup_tokens),
        hit_tokens=hits,
        stored_objects=float(after.stored_objects - before.stored_objects),
    )


__all__ = ["Observation", "observe", "read_status"]
