"""``BackendSettings``: the kvtier keys of SGLang's backend config.

SGLang hands a ``dynamic`` backend every key of
``--hicache-storage-backend-extra-config`` it does not use itself
(``storage_config.extra_config``). Ours, validated once at construction::

    address            the node's cache server, "tcp://127.0.0.1:5555" (required)
    salt               the tenant this engine registers under ("": none)
    model              the model name in the namespace (default: SGLang's model_name)
    revision           the weights' revision, part of the namespace ("")
    auth_token         the server's token for this tenant (""); better:
    auth_token_file    a file holding it (a command line shows in ps)
    request_timeout_s  one RPC's budget before it is a miss (2.0 s)

A missing or malformed key raises ``ValueError`` naming it: SGLang then fails
at start-up instead of serving with a backend that can never hit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import secret_file

# SGLang's own keys that reach the backend too; they are not ours to check.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_STRING_KEYS = ("address", "salt", "model", "revision", "auth_token", "auth_token_file")


@dataclass(frozen=True, slots=True)
class BackendSettings:
    address: str
    salt: str = ""
    model: str = ""
    revision: str = ""
    auth_token: str = ""
    request_timeout_s: float = 2.0

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, model_name: str | None
    ) -> BackendSettings:
        """The settings in SGLang's ``extra_config``; ``model_name`` (SGLang's
        served model) is the default ``model``. ValueError names the key."""
        extra = dict(extra or {})
        for key in _STRING_KEYS:
            if key in extra and not isinstance(extra[key], str):
                raise ValueError(
                    f"kvtier backend config: {key!r} must be a string, got {extra[key]!r}"
                )
        address = extra.get("address", "")
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(
                "kvtier backend config: 'address' must name the cache server, e.g. "
                f'"address": "tcp://127.0.0.1:5555"; got {address!r}'
            )
        model = extra.get("model") or model_name or ""
        if not model:
            raise ValueError(
                "kvtier backend config: 'model' is required when SGLang gives no model name"
            )
        timeout = extra.get("request_timeout_s", 2.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(
                f"kvtier backend config: 'request_timeout_s' must be a positive number of "
                f"seconds, got {timeout!r}"
            )
        return cls(
            address=address,
            salt=extra.get("salt", ""),
            model=model,
            revision=extra.get("revision", ""),
            auth_token=_token(extra),
            request_timeout_s=float(timeout),
        )


def _token(extra: Mapping[str, Any]) -> str:
    """``auth_token``, or the first line of ``auth_token_file`` (read as every
    secret file is: private, text; ``kvtier.config.secret_file``)."""
    token, path = extra.get("auth_token", ""), extra.get("auth_token_file", "")
    if token and path:
        raise ValueError("kvtier backend config: give 'auth_token' or 'auth_token_file', not both")
    if not path:
        return str(token)
    lines = secret_file(path, "kvtier backend config: 'auth_token_file'").splitlines()
    if not lines or not lines[0].strip():
        raise ValueError(f"kvtier backend config: 'auth_token_file' {path!r} is empty")
    return lines[0].strip()
