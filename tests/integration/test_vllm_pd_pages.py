"""Prefill and decode engines of different block sizes on vLLM's CPU build:
one with vLLM's CPU default of 128 tokens a block (core 0), one with 32
(core 1), each the other's producer and consumer behind ``kvtier pd-proxy``,
against one real ``kvtier serve``. The server re-pages each hand-off into
the consumer's block size (``kvtier.layout.repage``); outputs equal the
decoding engine's own (same tokens, |Δlogprob| <= 1e-4), and nothing stays
held.

On demand only (``KVTIER_LAYOUT_ENGINE_TESTS=1``): two more engines would
take CI past its time budget. What CI keeps: the re-paging is byte-exact
against vLLM's own kernel (``test_vllm_pages.py``), against the packing
written out (``tests/unit/layout/test_repage.py``) and through the server's
take (``tests/unit/server/test_handoffs.py``).
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

pytestmark = on_demand("KVTIER_LAYOUT_ENGINE_TESTS", "two more engines")

PROMPTS = [tokens(120 + i, n) for i, n in enumerate((700, 512, 200))]


@pytest.fixture(scope="module")
def engines(
    model_dir: Path, kv_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    logs = tmp_path_factory.mktemp("pd-pages")
    common = {"prefix_caching": False, "name": MODEL}
    configs = [
        (EngineOptions(model_dir, 4096, 1 << 30, cpus=str(core), block_size=block, **common), log)
        for core, block, log in ((0, 0, logs / "bs128.log"), (1, 32, logs / "bs32.log"))
    ]
    transfer = kvtier_transfer(kv_server.rpc)
    with vllm_servers([(options, transfer, log) for options, log in configs]) as pair:
        yield pair


@pytest.mark.parametrize("direction", ["128 to 32", "32 to 128"])
def test_hand_offs_between_block_sizes_are_repaged_and_equal_colocated(
    engines: tuple[Engine, Engine], kv_server: Server, direction: str
) -> None:
    big, small = engines
    prefill, decode = (big, small) if direction == "128 to 32" else (small, big)
    before = kv_server.status()["server"]["handoffs"]["resharded"]
    outcomes = hand_off_each(prefill, decode, PROMPTS, f"ref-{direction}")
    assert all(o["kvtier_handoff_outcome"] == "loaded" for o in outcomes), outcomes
    seen = wait_for(
        kv_server.status,
        lambda s: (
            s["server"]["handoffs"]["resharded"] - before == len(PROMPTS)
            and s["handoffs"]["held"] == 0
        ),
    )
    assert seen["server"]["handoffs"]["resharded"] - before == len(PROMPTS)
    assert seen["handoffs"]["held"] == 0
    assert seen["storage"]["held_lookup_locks"] == 0
