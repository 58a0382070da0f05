"""Prefill and decode engines of different TP sizes on vLLM's CPU build: a
TP 1 engine (core 0) and a TP 2 engine (cores 0 and 1), each the other's
producer and consumer behind ``kvtier pd-proxy``, against one real
``kvtier serve``. The server re-shards each hand-off by KV heads into the
consumer's ranks (vLLM's CPU pages, ``kvtier.layout.reshard``); outputs
equal the decoding engine's own (same tokens, |Δlogprob| <= 1e-4), and
nothing stays held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench.engines import Engine, EngineOptions, kvtier_transfer, vllm_servers
from tests.integration.harness import Server, post_json, wait_for

pytest.importorskip("vllm")
from tests.integration.test_vllm_connector import tokens
from tests.integration.test_vllm_pd import MODEL, NEW_TOKENS, assert_same, body, pd_proxy

pytestmark = [pytest.mark.slow, pytest.mark.engine]

PROMPTS = [tokens(100 + i, n) for i, n in enumerate((700, 512, 200))]


@pytest.fixture(scope="module")
def engines(
    model_dir: Path, kv_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    """A TP 1 engine and a TP 2 engine (the test model's 2 KV heads: one a rank)."""
    logs = tmp_path_factory.mktemp("pd-tp")
    common = {"prefix_caching": False, "name": MODEL}
    configs = [
        (EngineOptions(model_dir, 4096, 1 << 30, cpus="0", **common), logs / "tp1.log"),
        (
            EngineOptions(model_dir, 4096, 1 << 30, cpus="0|1", tensor_parallel=2, **common),
            logs / "tp2.log",
        ),
    ]
    transfer = kvtier_transfer(kv_server.rpc)
    with vllm_servers([(options, transfer, log) for options, log in configs]) as (tp1, tp2):
        yield tp1, tp2


@pytest.mark.parametrize("direction", ["tp1 to tp2", "tp2 to tp1"])
def test_hand_offs_between_tp_sizes_are_resharded_and_equal_colocated(
    engines: tuple[Engine, Engine], kv_server: Server, direction: str
) -> None:
    tp1, tp2 = engines
    prefill, decode = (tp1, tp2) if direction == "tp1 to tp2" else (tp2, tp1)
    before = kv_server.status()["server"].get("handoffs.resharded", 0)
    with pd_proxy(prefill, decode) as proxy:
        for i, prompt in enumerate(PROMPTS):
            # The decoding engine's own output (its own salt: nothing reused).
            status, colocated = post_json(
                decode.url + "/v1/completions", body(prompt, cache_salt=f"ref-{direction}")
            )
            assert status == 200, colocated
            status, pd = post_json(proxy + "/v1/completions", body(prompt))
            assert status == 200, pd
            assert_same(colocated, pd, f"{direction}, prompt {i} ({len(prompt)} tokens)")
            assert pd["usage"]["completion_tokens"] == NEW_TOKENS
            assert pd["usage"]["kvtier_handoff"]["kvtier_handoff_outcome"] == "loaded", pd
    seen = wait_for(
        kv_server.status,
        lambda s: (
            s["server"].get("handoffs.resharded", 0) - before == len(PROMPTS)
            and s["handoffs"]["held"] == 0
        ),
    )
    assert seen["server"]["handoffs.resharded"] - before == len(PROMPTS)
    assert seen["handoffs"]["held"] == 0
    assert seen["storage"]["held_lookup_locks"] == 0
