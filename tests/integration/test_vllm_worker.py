"""The connector's worker side against a real ``kvtier serve``, without an
engine: asynchronous loads (``kvtier.load_async``) copy on the worker's load
thread, are reported done once each, and report every chunk that did not
come back as failed blocks, so vLLM recomputes them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.integration.harness import Server, wait_for

pytest.importorskip("vllm")
from kvtier.engine.vllm.metadata import KVTierMetadata, LoadSpec
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.worker import WorkerSide
from tests.integration.test_vllm_scheduler import BLOCK, prompt, store_chunks, vllm_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # needs vLLM

BLOCKS = 8  # engine blocks per layer


def worker_side(monkeypatch: pytest.MonkeyPatch, address: str) -> WorkerSide:
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    settings = ConnectorSettings(address=address, load_async=True, request_timeout_s=0.5)
    side = WorkerSide(vllm_config(), settings)
    # vLLM-CPU's pages: [blocks, kv heads 2, block size, 2 * head dim 64], made
    # as vLLM makes them: inference tensors, whose views only inference mode
    # may write; the worker's page views are first made in inference mode too
    # (vLLM runs the step's connector calls in it)
    with torch.inference_mode():
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, 2, BLOCK, 128) for i in range(2)
        }
        side.register_kv_caches(caches)
        side._paged_kv(256)
    return side


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch, server: Server) -> Iterator[WorkerSide]:
    side = worker_side(monkeypatch, server.rpc)
    yield side
    side.close()


def run_async(side: WorkerSide, spec: LoadSpec) -> set[int]:
    """Start one asynchronous load as vLLM would; its failed blocks once done."""
    side.begin_step()
    side.start_load_kv(KVTierMetadata(loads=[spec]))
    finished: set[str] = set()
    errors: set[int] = set()

    def step() -> set[str]:  # get_finished, then the load errors, as vLLM asks each step
        finished.update(side.get_finished(set())[1])
        errors.update(side.get_block_ids_with_load_errors())
        return finished

    assert wait_for(step, lambda done: spec.request_id in done) == {spec.request_id}
    assert side.get_finished(set()) == (set(), set())  # reported once
    return errors


def pages(side: WorkerSide, block: int) -> set[int]:
    """The distinct byte values of one engine block, over both layers."""
    caches = side._kv_caches.values()
    return {int(v) for t in caches for v in np.unique(t[block].numpy().view(np.uint8))}


def test_an_asynchronous_load_fills_its_blocks_on_the_load_thread(worker: WorkerSide) -> None:
    tokens = prompt(600, seed=21)
    assert store_chunks(worker, tokens) == 2  # chunk i's bytes are all i
    hashes = worker.clients.hasher("", 256).chunk_hashes(tokens)
    spec = LoadSpec("r", "", 0, hashes, [[{1: 1}], [{0: 2, 1: 3}]], asynchronous=True)
    assert run_async(worker, spec) == set()
    assert [pages(worker, b) for b in range(5)] == [{0}, {0}, {1}, {1}, {0}]
    assert worker.stats["loaded_chunks"] == 2


def test_chunks_that_do_not_come_back_are_failed_blocks(worker: WorkerSide) -> None:
    tokens = prompt(600, seed=22)
    hashes = worker.clients.hasher("", 256).chunk_hashes(tokens)
    store_chunks(worker, tokens[:256])  # only chunk 0 is in kvtier
    spec = LoadSpec("half", "", 0, hashes, [[{0: 4, 1: 5}], [{0: 6, 1: 7}]], asynchronous=True)
    assert run_async(worker, spec) == {6, 7}
    assert (worker.stats["loaded_chunks"], worker.stats["failed_chunks"]) == (1, 1)


def test_with_the_server_away_every_block_fails_and_the_load_still_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker_side(monkeypatch, "tcp://127.0.0.1:9")
    try:
        spec = LoadSpec("away", "", 0, [b"\x01" * 16], [[{0: 1, 1: 2}]], asynchronous=True)
        assert run_async(side, spec) == {1, 2}
    finally:
        side.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_reported_forward_excludes_the_loads_whichever_side_of_it_they_run(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """vLLM calls start_load_kv before the forward when the step has
    synchronous loads and after it otherwise; the forward reported to the
    savings ledger is the forward's time alone either way."""
    clock = Clock()
    monkeypatch.setattr("kvtier.engine.vllm.worker.time.perf_counter", clock)
    forwards: list[tuple[float, int]] = []
    client = worker.clients.client("")
    assert client is not None
    monkeypatch.setattr(
        client, "report_usage", lambda seconds, tokens, *loaded: forwards.append((seconds, tokens))
    )

    def load(spec: LoadSpec) -> int:
        if not spec.asynchronous:  # a synchronous load of 5 s (on the load thread: beside it)
            clock.now += 5.0
        return 256

    monkeypatch.setattr(worker, "_load", load)
    spec = LoadSpec("timed", "", 0, [b"\x02" * 16], [[{0: 1, 1: 2}]], asynchronous=asynchronous)
    meta = KVTierMetadata(loads=[spec], computed_tokens=1000)
    worker.begin_step()
    if asynchronous:  # the forward (2 s), then the loads start on the load thread
        clock.now += 2.0
        worker.start_load_kv(meta)
        wait_for(lambda: worker.get_finished(set())[1], lambda done: "timed" in done)
    else:  # the loads (5 s), then the forward (2 s)
        worker.start_load_kv(meta)
        clock.now += 2.0
    worker.wait_for_save(meta)
    assert forwards == [(pytest.approx(2.0), 1000)]
