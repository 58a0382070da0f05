"""Prefill and decode engines of different TP sizes on vLLM's CPU build: a
TP 1 engine (core 0) and a TP 2 engine (cores 0 and 1), each the other's
producer and consumer behind ``kvtier pd-proxy``, against one real
``kvtier serve``. The server re-shards each hand-off by KV heads into the
consumer's ranks (vLLM's CPU pages, ``kvtier.layout.reshard``); outputs
equal the decoding engine's own (same tokens, |Δlogprob| <= 1e-4), and
nothing stays held.

On demand only (``KVTIER_TP_ENGINE_TESTS=1``): three engine processes on a
2-core machine already stall one hand-off in tens (one of the TP 2 engine's
kvtier requests is answered only after its client's timeout; not explained
yet, docs/disaggregation.md), and beside CI's other engine module every TP 2
consumer's load stalls that way, so the hand-offs are recomputed (the output
is still right) and the test cannot say whether re-sharding works there. The
re-sharding itself is byte-exact in ``tests/unit/layout/test_reshard.py`` and
``tests/unit/server/test_handoffs.py``, and the connector's TP 1 -> TP 2
take runs against a real server in ``test_vllm_handoff.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench.engines import Engine, EngineOptions, kvtier_transfer, vllm_servers
from tests.integration.harness import Server, wait_for

pytest.importorskip("vllm")
from tests.integration.test_vllm_connector import tokens
from tests.integration.test_vllm_pd import MODEL, hand_off_each, on_demand

pytestmark = on_demand("KVTIER_TP_ENGINE_TESTS", "a TP 2 engine on two cores stalls under load")

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
    # Three engine processes spin on two cores here: a reply can be seconds late, and a
    # server silent for the default 2 s would count as away (a miss, then a recompute).
    transfer = kvtier_transfer(kv_server.rpc, request_timeout_s=15.0)
    with vllm_servers([(options, transfer, log) for options, log in configs]) as (tp1, tp2):
        yield tp1, tp2


# Where a hand-off on this 2-core VM is recomputed instead (about one in tens of
# hand-offs with the TP 2 engine: one of its kvtier requests goes unanswered until
# its client's timeout; not explained yet, see docs/disaggregation.md).
STALLED = {"server_away", "incomplete_load", "not_offered"}


@pytest.mark.parametrize("direction", ["tp1 to tp2", "tp2 to tp1"])
def test_hand_offs_between_tp_sizes_are_resharded_and_equal_colocated(
    engines: tuple[Engine, Engine], kv_server: Server, direction: str
) -> None:
    tp1, tp2 = engines
    prefill, decode = (tp1, tp2) if direction == "tp1 to tp2" else (tp2, tp1)
    before = kv_server.status()["server"]["handoffs"]["resharded"]
    outcomes = hand_off_each(prefill, decode, PROMPTS, f"ref-{direction}")
    loaded = sum(o["kvtier_handoff_outcome"] == "loaded" for o in outcomes)
    assert loaded >= len(PROMPTS) - 1, outcomes  # every output above is right either way
    assert all(
        o["kvtier_handoff_outcome"] == "loaded" or o.get("kvtier_handoff_cause") in STALLED
        for o in outcomes
    ), outcomes
    seen = wait_for(
        kv_server.status,
        lambda s: (
            s["server"]["handoffs"]["resharded"] - before >= loaded and s["handoffs"]["held"] == 0
        ),
        timeout_s=45,  # a hand-off not consumed is held until its 30 s lease
    )
    assert seen["server"]["handoffs"]["resharded"] - before >= loaded
    assert seen["handoffs"]["held"] == 0
    assert seen["storage"]["held_lookup_locks"] == 0
