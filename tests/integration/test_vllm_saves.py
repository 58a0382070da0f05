"""Stores that leave the engine step, against a real ``kvtier serve``: the
connector's worker side driven the way vLLM's model runner drives it
(stand-in configuration, CPU KV tensors; no engine), and its scheduler side's
half of the bargain: a request whose stores left the step keeps its blocks
until every worker names it finished sending."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.integration.harness import Server, wait_for

pytest.importorskip("vllm")
from kvtier.engine.vllm import worker as worker_module
from kvtier.engine.vllm.metadata import KVTierMetadata, StoreSpec
from kvtier.engine.vllm.scheduler import SchedulerSide
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.worker import WorkerSide
from tests.integration.test_vllm_scheduler import (
    BLOCK,
    CHUNK,
    Blocks,
    parked_step,
    prompt,
    request,
    vllm_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # needs vLLM

BLOCKS = 16
PER_CHUNK = CHUNK // BLOCK


@pytest.fixture
def worker(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerSide]:
    """Rank 0's worker side over two layers of random KV."""
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    side = WorkerSide(vllm_config(), ConnectorSettings(address=server.rpc, request_timeout_s=30))
    side.register_kv_caches(
        {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, 2, BLOCK, 128) for i in range(2)}
    )
    yield side
    side.close()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Stores wait until the test opens the gate (a slow L1, a busy CPU)."""
    opened = threading.Event()
    store = worker_module.WorkerSide._store

    def gated(self: WorkerSide, spec: StoreSpec, ready: Any, beside_forward: bool = False) -> None:
        assert opened.wait(60), "the test never opened the gate"
        store(self, spec, ready, beside_forward)

    monkeypatch.setattr(worker_module.WorkerSide, "_store", gated)
    yield opened
    opened.set()


def store_spec(worker: WorkerSide, request_id: str, seed: int) -> StoreSpec:
    hashes = worker.clients.hasher("", CHUNK).chunk_hashes(prompt(2 * CHUNK, seed))
    return StoreSpec(request_id, "", hashes, [list(range(1, 2 * PER_CHUNK + 1))])  # 0: null


def resident(worker: WorkerSide, spec: StoreSpec) -> bool:
    client = worker.clients.client("")
    assert client is not None
    state = client.lookup("probe", spec.hashes, wait_s=30)
    client.end_session("probe")
    return state.hit_chunks == len(spec.hashes)


def test_the_step_returns_before_its_stores_and_the_blocks_wait_for_them(
    worker: WorkerSide, gate: threading.Event
) -> None:
    spec = store_spec(worker, "r", seed=1)
    worker.wait_for_save(KVTierMetadata(stores=[spec]))  # returns with the store held at the gate
    assert not resident(worker, spec)
    assert worker.get_finished({"r"}) == (set(), set())  # finished, its saves are not
    gate.set()
    sent = wait_for(lambda: worker.get_finished(set())[0], bool)
    assert sent == {"r"} and resident(worker, spec)
    assert worker.get_finished(set()) == (set(), set())  # named once


def test_a_preempted_requests_saves_finish_before_the_next_forward(
    worker: WorkerSide, gate: threading.Event
) -> None:
    spec = store_spec(worker, "p", seed=2)
    worker.wait_for_save(KVTierMetadata(stores=[spec]))
    waiting = threading.Thread(
        target=worker.handle_preemptions, args=(KVTierMetadata(preempted=["p"]),)
    )
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive(), "the next forward would run while the store reads freed blocks"
    gate.set()
    waiting.join(60)
    assert not waiting.is_alive() and resident(worker, spec)
    worker.handle_preemptions(KVTierMetadata(preempted=["other"]))  # nothing of it: no wait


def test_stores_kept_in_the_step_are_committed_when_it_returns(
    worker: WorkerSide, gate: threading.Event
) -> None:
    gate.set()
    spec = store_spec(worker, "h", seed=3)
    spec.in_step = True  # a prefill engine's hand-off
    worker.wait_for_save(KVTierMetadata(stores=[spec]))
    assert resident(worker, spec)
    assert worker.get_finished({"h"}) == (set(), set())  # vLLM did not hold its blocks


def test_a_store_that_fails_still_frees_the_blocks(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: WorkerSide, spec: StoreSpec, ready: Any, beside_forward: bool = False) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(worker_module.WorkerSide, "_store", broken)
    worker.wait_for_save(KVTierMetadata(stores=[store_spec(worker, "f", seed=4)]))
    assert wait_for(lambda: worker.get_finished({"f"})[0], bool) == {"f"}


def test_stored_pages_are_the_blocks_the_forward_wrote(worker: WorkerSide) -> None:
    spec = store_spec(worker, "x", seed=5)
    worker.wait_for_save(KVTierMetadata(stores=[spec]))
    wait_for(lambda: worker.get_finished({"x"})[0], bool)
    client = worker.clients.client("")
    assert client is not None
    paged = worker._paged_kv(CHUNK)
    expected = np.zeros(paged.object_bytes, np.uint8)
    paged.copy_out([spec.block_ids[0][PER_CHUNK:]], expected)
    read: list[bytes] = []
    state = client.lookup("read", spec.hashes, wait_s=30)
    assert state.hit_chunks == 2
    client.retrieve_with("read", 0, 2, lambda i, view: read.append(view.tobytes()))
    client.end_session("read")
    assert read[1] == expected.tobytes()


@pytest.mark.parametrize("save_async", [True, False])
def test_the_scheduler_holds_the_blocks_of_a_request_whose_stores_left_the_step(
    server: Server, save_async: bool
) -> None:
    settings = ConnectorSettings(address=server.rpc, lookup_wait_s=10.0, save_async=save_async)
    side = SchedulerSide(vllm_config(), settings)
    try:
        tokens = prompt(700, seed=60)
        assert side.get_num_new_matched_tokens(request("s", tokens), 0) == (0, False)
        side.update_state_after_alloc(request("s", tokens), Blocks([1, 2, 3, 4, 5, 6]), 0)
        step = parked_step()
        step.scheduled_new_reqs = [
            SimpleNamespace(req_id="s", block_ids=([1, 2, 3, 4, 5, 6],), num_computed_tokens=0)
        ]
        step.num_scheduled_tokens = {"s": 700}
        (store,) = side.build_connector_meta(step).stores
        assert store.in_step is not save_async
        preempting = parked_step()
        preempting.preempted_req_ids = {"s"}
        assert side.build_connector_meta(preempting).preempted == ["s"]
        resumed = request("s", tokens, preemptions=1)  # looked up afresh, tracked anew
        assert side.get_num_new_matched_tokens(resumed, 0)[0] is not None
        held, _ = side.request_finished(resumed, [])
        assert held is save_async  # the workers name it once their saves are done
    finally:
        side.close()


def test_a_resumed_request_without_blocks_yet_stores_nothing(server: Server) -> None:
    """A resumed request vLLM gave no block this step (``new_block_ids`` None)."""
    side = SchedulerSide(vllm_config(), ConnectorSettings(address=server.rpc, lookup_wait_s=10.0))
    try:
        tokens = prompt(700, seed=61)
        assert side.get_num_new_matched_tokens(request("z", tokens), 0) == (0, False)
        side.update_state_after_alloc(request("z", tokens), Blocks([]), 0)
        step = parked_step()
        step.scheduled_cached_reqs = SimpleNamespace(
            req_ids=["z"], resumed_req_ids={"z"}, new_block_ids=[None], num_computed_tokens=[0]
        )
        step.num_scheduled_tokens = {"z": 700}
        assert side.build_connector_meta(step).stores == []
        side.request_finished(request("z", tokens), [])
    finally:
        side.close()
