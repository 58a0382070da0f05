"""``kvtier admin``: the operator's command line over the admin JSON API
(``kvtier.operations.admin_api``) of one ``kvtier serve``.

The token of an admin tenant comes from ``--token-file`` or the environment
(``KVTIER_ADMIN_TOKEN``, else ``KVTIER_AUTH_TOKEN``), never from a flag (a
command line shows in ``ps``). ``kvtier admin token-digest`` prints the
SHA-256 digest a tenants file holds for a token read from standard input.
Every command prints a readable report; ``--json FILE`` also writes the
answer as JSON (``-``: standard output). ``purge --wait`` exits 1 unless
every job it started is done (one failed, or still ran at ``--timeout-s``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from kvtier.config import secret
from kvtier.output import JSON_HELP, report_stream, write_json
from kvtier.tenancy.tenants import token_digest
from kvtier.units import format_size

DEFAULT_URL = "http://127.0.0.1:8765"


class AdminError(RuntimeError):
    pass


def _token(args: argparse.Namespace) -> str:
    return secret(args.token_file, "--token-file", "KVTIER_ADMIN_TOKEN") or os.environ.get(
        "KVTIER_AUTH_TOKEN", ""
    )


def call(url: str, token: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One admin API call; AdminError with the server's message on a refusal."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace").strip()
        with contextlib.suppress(ValueError, AttributeError):
            text = json.loads(text).get("error", text)
        raise AdminError(f"{method} {path}: {exc.code} {text}") from None
    except OSError as exc:
        raise AdminError(f"cannot reach the admin port at {url}: {exc}") from None
    except (http.client.HTTPException, ValueError) as exc:  # cut off, or not JSON
        raise AdminError(
            f"{method} {path}: the admin port at {url} sent a broken answer "
            f"({type(exc).__name__}: {exc}); is the server restarting? try again"
        ) from None


def _run(args: argparse.Namespace) -> int:
    if args.admin_command == "token-digest":
        token = sys.stdin.readline().strip()
        if not token:
            print("give the token on standard input", file=sys.stderr)
            return 2
        print(token_digest(token))
        return 0
    try:
        answer = _ACTIONS[args.admin_command](args, _token(args))
    except AdminError as exc:
        print(f"kvtier admin: {exc}", file=sys.stderr)
        return 1
    stream = report_stream(args.json)
    for line in _render(args.admin_command, answer):
        print(line, file=stream)
    if args.json:
        write_json(args.json, answer)
    if args.admin_command == "purge" and args.wait:
        unfinished = [j["id"] for j in answer["purges"] if j["state"] != "done"]
        if unfinished:  # a script's `purge --wait && ...` must not go on as if purged
            print(f"kvtier admin: purges not done: {', '.join(unfinished)}", file=sys.stderr)
            return 1
    return 0


def _purge(args: argparse.Namespace, token: str) -> Any:
    body: dict[str, Any] = {}
    if args.tenant:
        body["tenant"] = args.tenant
    if args.model:
        body["model"] = args.model
    if args.salt is not None:
        body["salt"] = args.salt
    started = call(args.url, token, "POST", "/admin/purge", body)
    if not args.wait:
        return started
    jobs = set(started["jobs"])
    deadline = time.monotonic() + args.timeout_s
    while True:
        listed = call(args.url, token, "GET", "/admin/purges")["purges"]
        purges = [j for j in listed if j["id"] in jobs]
        if all(j["state"] != "running" for j in purges) or time.monotonic() > deadline:
            return {"jobs": list(jobs), "purges": purges}
        done = sum(j["deleted"] for j in purges)
        print(f"purging: {done} objects deleted so far", file=sys.stderr)
        time.sleep(1.0)


def _pin(args: argparse.Namespace, token: str, path: str) -> Any:
    body = {"model": args.model, "salt": args.salt or "", "hashes": args.hashes}
    if path == "/admin/pin":
        body["ttl_s"] = args.ttl_s
    return call(args.url, token, "POST", path, body)


def _quota(args: argparse.Namespace, token: str) -> Any:
    body: dict[str, Any] = {"tenant": args.tenant}
    for name in ("l1_bytes", "l1_hard_bytes", "pin_bytes"):
        value = getattr(args, name)
        if value is not None:
            body[name] = None if value == "none" else value
    return call(args.url, token, "POST", "/admin/quota", body)


_ACTIONS = {
    "status": lambda a, t: call(a.url, t, "GET", "/admin/status"),
    "tenants": lambda a, t: call(a.url, t, "GET", "/admin/tenants"),
    "namespaces": lambda a, t: call(a.url, t, "GET", "/admin/namespaces"),
    "purges": lambda a, t: call(a.url, t, "GET", "/admin/purges"),
    "ledger": lambda a, t: call(a.url, t, "GET", "/admin/ledger"),
    "drain": lambda a, t: call(a.url, t, "POST", "/admin/drain", {"on": not a.off}),
    "pin": lambda a, t: _pin(a, t, "/admin/pin"),
    "unpin": lambda a, t: _pin(a, t, "/admin/unpin"),
    "purge": _purge,
    "quota": _quota,
}


def _render(command: str, answer: Any) -> list[str]:
    """A readable report of an answer (the JSON has everything)."""
    if command == "tenants":
        lines = []
        for t in answer["tenants"]:
            usage = ", ".join(f"{tier} {format_size(n)}" for tier, n in t["usage"].items())
            role = " (admin)" if t["admin"] else ""
            lines.append(f"{t['name']}{role}: salts {', '.join(t['salts'])}; {usage}")
        return lines
    if command == "namespaces":
        return [
            f"{n['namespace']} [{n['tenant']}]: "
            + ", ".join(
                f"{tier} {v['objects']} objects {format_size(v['bytes'])}"
                for tier, v in n["tiers"].items()
            )
            for n in answer["namespaces"]
        ]
    if command in ("purge", "purges"):
        return [
            f"purge {j['id']} {j['namespace']}: {j['state']}, {j['deleted']} deleted ("
            + ", ".join(f"{tier} {p['deleted']}" for tier, p in j["tiers"].items())
            + ")"
            for j in answer["purges"]
        ]
    if command == "ledger":
        return [
            f"{r['tenant']} {r['namespace']}: served "
            + ", ".join(f"{tier} {n} tokens" for tier, n in r["served_tokens"].items())
            + f"; loaded {r['loaded_tokens']} tokens"
            + (
                f"; saved {r['saved_s']:.3f} s, loads {r['load_s']:.3f} s, net {r['net_s']:.3f} s"
                if r["saved_s"] is not None
                else "; no prefill rate reported"
            )
            for r in answer["namespaces"]
        ]
    return [json.dumps(answer, indent=1)]


def add_parser(commands: Any) -> None:
    admin = commands.add_parser(
        "admin",
        help="operate a kvtier serve: tenants, namespaces, pins, purges, drain, quotas, ledger",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admin.add_argument("--url", default=DEFAULT_URL, help=f"the admin port ({DEFAULT_URL})")
    admin.add_argument("--token-file", help="a file holding an admin tenant's token")
    admin.add_argument("--json", metavar="FILE", help=JSON_HELP)
    sub = admin.add_subparsers(dest="admin_command", required=True)
    for name, text in (
        ("status", "uptime, draining, L1, tenants, running purges"),
        ("tenants", "each tenant: salts, role, quotas, usage per tier"),
        ("namespaces", "each model@salt: objects and bytes per tier"),
        ("purges", "purge jobs and their progress"),
        ("ledger", "the savings ledger: tokens served and loaded, seconds saved and spent"),
        ("token-digest", "print the SHA-256 digest of a token read from standard input"),
    ):
        sub.add_parser(name, help=text)
    for name in ("pin", "unpin"):
        pin = sub.add_parser(name, help=f"{name} chunks in L1 (their hashes, docs/hashing.md)")
        pin.add_argument("--model", required=True, help="the model label of the namespace")
        pin.add_argument("--salt", default="", help="the namespace's salt (the tenant's)")
        pin.add_argument("--hashes", nargs="+", required=True, help="chunk hashes in hex")
        if name == "pin":
            pin.add_argument("--ttl-s", type=float, default=3600.0, help="how long (3600)")
    purge = sub.add_parser("purge", help="remove a namespace's or a tenant's objects everywhere")
    purge.add_argument("--model", help="a model name: its objects (with --salt: in that salt)")
    purge.add_argument("--salt", help="a salt: its objects (every model unless --model)")
    purge.add_argument("--tenant", help="a tenant: every salt it owns")
    purge.add_argument("--wait", action="store_true", help="poll until the jobs end")
    purge.add_argument("--timeout-s", type=float, default=3600.0, help="how long --wait waits")
    drain = sub.add_parser("drain", help="stop taking stores (lookups still served)")
    drain.add_argument("--off", action="store_true", help="take stores again")
    quota = sub.add_parser("quota", help="change a tenant's L1 quota (evicts down to it)")
    quota.add_argument("--tenant", required=True)
    quota.add_argument("--l1-bytes", help="soft: e.g. 4GiB ('none': no limit)")
    quota.add_argument("--l1-hard-bytes", help="hard: e.g. 6GiB ('none')")
    quota.add_argument("--pin-bytes", help="pin cap ('none': the server's share of L1 only)")
    admin.set_defaults(run=_run)


__all__ = ["AdminError", "add_parser", "call"]
