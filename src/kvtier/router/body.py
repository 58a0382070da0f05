"""A client's request body, read and checked before anything is charged.

``read_body`` parses the bytes as strict JSON (no ``NaN``, ``Infinity`` or
number past a float's range): an object, nested at most ``MAX_DEPTH`` deep
(an OpenAI request nests a few levels; a tool's schema a few dozen).
``check_body`` checks the fields the router itself reads (``model``,
``stream``, the token limits) and refuses the fields that belong to kvtier
and the engine, not to a tenant (``ENGINE_FIELDS``). Both raise ``BadRequest``, which names
the field to change; nothing has been charged to the tenant at that point.

Refused, not stripped: a client that sends ``priority`` or
``kv_transfer_params`` believes it is honoured; a 400 naming the field tells
it at once that it is not, where a silent strip would answer something other
than what was asked. ``cache_salt`` is the one exception: the gateway sets it
to the tenant's (module ``gateway``), as an OpenAI client may send its own.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 100  # nesting of arrays and objects
MAX_TOKEN_ID = 2**32 - 1  # chunk hashes encode token ids as uint32 (docs/hashing.md)

# Fields vLLM's OpenAI server takes that only kvtier (the P/D proxy, the
# connector) or the operator may set: field -> why a tenant may not.
ENGINE_FIELDS = {
    "kv_transfer_params": "it drives the engine's KV hand-off (kvtier pd-proxy sets it)",
    "ec_transfer_params": "it drives the engine's encoder-cache hand-off",
    "priority": "it would put the request ahead of other tenants' in the engine's queue",
    "request_id": "the engine's request ids are the router's to choose",
    "vllm_xargs": "it passes arguments to the engine's extensions",
    "prompt_embeds": "the prompt is tokenized and counted by the router, not sent as embeddings",
    "chat_template": "the chat is rendered with the model's own template, which the router counts",
}


class BadRequest(ValueError):
    """A request refused before any work was done for it (4xx, counted by ``reason``)."""

    reason = "bad_request"

    def __init__(
        self, message: str, reason: str = "", status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.reason = reason or self.reason
        self.status = status
        self.kind = kind


def read_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``BadRequest`` (reason ``bad_json``) if it is not one."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadRequest(f"the body is not JSON: {exc}", "bad_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", "bad_json")
    if _depth(body) > MAX_DEPTH:
        raise _too_deep()
    return body


def check_body(body: dict[str, Any], served_model: str) -> None:
    """The fields the router reads have the types it needs; no engine field is set.
    ``BadRequest`` naming the field otherwise (404 for a model not served here)."""
    for name, why in ENGINE_FIELDS.items():
        if name in body:
            raise BadRequest(f"'{name}' may not be set by a client: {why}", "engine_field")
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise BadRequest("'model' must be a string", "bad_field")
    if asked and served_model and asked != served_model:
        raise BadRequest(
            f"model {asked!r} is not served here; /v1/models lists {served_model!r}",
            "unknown_model",
            404,
            "model_not_found",
        )
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", "bad_field")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 0):
            raise BadRequest(f"'{name}' must be a non-negative integer", "bad_field")


def output_tokens(body: dict[str, Any]) -> int:
    """The most tokens the request asks the engine to generate (1 if it does not say)."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    return limit or 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float; one past float's range (``1e400``) is refused,
    not read as infinity (which the engine would be sent as ``Infinity``)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]}... is too large")
    return value


def _too_deep() -> BadRequest:
    return BadRequest(f"the body nests arrays or objects more than {MAX_DEPTH} deep", "bad_json")


def _depth(value: Any) -> int:
    """How deep ``value`` nests (iteratively: the body may be as deep as the parser allowed)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > deepest:
            deepest = depth
            if deepest > MAX_DEPTH:
                break
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


__all__ = [
    "ENGINE_FIELDS",
    "MAX_DEPTH",
    "MAX_TOKEN_ID",
    "BadRequest",
    "check_body",
    "output_tokens",
    "read_body",
]
