"""The connector's scheduler side against a real ``kvtier serve``, driven the
way vLLM's scheduler drives it (requests, block lists and scheduler outputs
are stand-ins; no engine). Checks the hit it offers, the loads it emits, and
that every lock it takes is released."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient, ClientConfig
from tests.integration.conftest import Gated
from tests.integration.harness import Server, wait_for

pytest.importorskip("vllm")
from kvtier.engine.vllm.scheduler import PROBE_EVERY, SchedulerSide
from kvtier.engine.vllm.settings import ConnectorSettings

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # needs vLLM

BLOCK = 128
CHUNK = 256


class FakeModelConfig:
    model = "org/tiny"
    revision = "r1"  # a hub id not in the local hub cache: its revision must be given
    dtype = torch.float32
    use_mla = False
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "rope_theta": 1e4})

    def get_num_layers(self, parallel: Any) -> int:
        return 2

    def get_num_kv_heads(self, parallel: Any) -> int:
        return max(1, 2 // parallel.tensor_parallel_size)

    def get_total_num_kv_heads(self) -> int:
        return 2

    def get_head_size(self) -> int:
        return 64


def vllm_config(tp: int = 1) -> Any:
    return SimpleNamespace(
        model_config=FakeModelConfig(),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
    )


def request(
    request_id: str, prompt: list[int], preemptions: int = 0, salt: str | None = None
) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        num_preemptions=preemptions,
        cache_salt=salt,
    )


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 1000, n)]


@pytest.fixture
def side(server: Server) -> Any:
    # A lookup budget long enough that an answer always comes within it here
    # (the default, 20 ms, defers a request whose answer is later).
    settings = ConnectorSettings(address=server.rpc, lookup_wait_s=10.0)
    scheduler = SchedulerSide(vllm_config(), settings)
    yield scheduler
    scheduler.close()


def store_chunks(side: SchedulerSide, tokens: list[int], salt: str = "") -> int:
    """Store every full chunk of ``tokens`` as a rank-0 worker would."""
    return store_objects(side, side.clients.hasher(salt, CHUNK).chunk_hashes(tokens), salt)


def store_objects(side: SchedulerSide, hashes: list[bytes], salt: str = "") -> int:
    """Store an object under each of ``hashes`` (filled with its index) as a
    rank-0 worker would."""
    pool = side.clients
    client = pool.client(salt)
    assert client is not None and client.chunk_size == CHUNK
    size = pool.layout(CHUNK).object_bytes()
    worker = CacheClient(
        ClientConfig(
            address=side.settings.address,
            model=client.config.model,
            layouts=client.config.layouts,
            revision=client.config.revision,
            salt=salt,
            rank=0,
            block_alignment=BLOCK,
        )
    )
    try:
        stored = worker.store("w", hashes, [np.full(size, i, np.uint8) for i in range(len(hashes))])
        worker.end_session("w")
        return stored
    finally:
        worker.close()


def held(side: SchedulerSide) -> int:
    """Lookup locks the server holds now (its live tables, not the HTTP snapshot)."""
    client = side.clients.client("")
    status = client.status() if client is not None else None
    assert status is not None
    return status.storage.held_lookup_locks


def test_offers_the_hit_beyond_the_engines_own_and_unlocks_everything(
    side: SchedulerSide, server: Server
) -> None:
    tokens = prompt(700)
    assert store_chunks(side, tokens) == 2
    req = request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    assert side.get_num_new_matched_tokens(req, 128) == (384, False)  # asked again: same lookup
    side.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14, 15]), 384)
    meta = side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id="r1", block_ids=([10, 11, 12, 13, 14, 15],), num_computed_tokens=512
                )
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
            ),
            num_scheduled_tokens={"r1": 188},
        )
    )
    (load,) = meta.loads
    assert (load.first_chunk, load.blocks) == (0, [[{1: 11}], [{0: 12, 1: 13}]])
    assert meta.stores == []  # 700 tokens: no chunk beyond the 2 in kvtier
    assert held(side) == 2  # the chunks being loaded stay locked until the step is back
    side.update_connector_output(None)
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0
    side.request_finished(req, [])
    assert held(side) == 0


def test_a_full_hit_stops_one_token_short(side: SchedulerSide, server: Server) -> None:
    tokens = prompt(512, seed=1)
    assert store_chunks(side, tokens) == 2
    req = request("full", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (511, False)
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 511)
    side.request_finished(req, [])  # finished before the load step came back
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0


def test_engine_hit_covers_everything_then_all_locks_go(
    side: SchedulerSide, server: Server
) -> None:
    tokens = prompt(600, seed=2)
    store_chunks(side, tokens)
    req = request("own", tokens)
    assert side.get_num_new_matched_tokens(req, 512) == (0, False)
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 0)
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0
    side.request_finished(req, [])


def test_other_salt_misses_and_preemption_looks_up_afresh(
    side: SchedulerSide, server: Server
) -> None:
    tokens = prompt(520, seed=3)
    store_chunks(side, tokens, salt="tenant-a")
    assert side.get_num_new_matched_tokens(request("b", tokens, salt="tenant-b"), 0) == (0, False)
    req = request("a", tokens, salt="tenant-a")
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 512)
    preempted = request("a", tokens, preemptions=1, salt="tenant-a")  # its blocks were freed
    assert side.get_num_new_matched_tokens(preempted, 0) == (512, False)
    side.update_state_after_alloc(preempted, Blocks([7, 8, 9, 10, 11]), 0)
    side.request_finished(preempted, [])
    side.request_finished(request("b", tokens, salt="tenant-b"), [])
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0


def test_server_away_is_a_miss_not_an_error(server: Server) -> None:
    settings = ConnectorSettings(address="tcp://127.0.0.1:9", request_timeout_s=0.2)
    side = SchedulerSide(vllm_config(), settings)
    try:
        assert side.get_num_new_matched_tokens(request("x", prompt(700)), 0) == (0, False)
    finally:
        side.close()


def connected_side(address: str, lookup_wait_s: float) -> SchedulerSide:
    """A scheduler side whose client has said HELLO. A new client waits no
    longer than the lookup budget for it, which a loaded machine can miss;
    these tests are about the lookups, not the connection."""
    settings = ConnectorSettings(address=address, lookup_wait_s=lookup_wait_s, request_timeout_s=30)
    side = SchedulerSide(vllm_config(), settings)
    wait_for(lambda: side.clients.client(""), lambda client: client is not None)
    return side


def test_a_slow_lookup_defers_the_request_instead_of_blocking(gated: Gated) -> None:
    """Issue 15: the scheduler thread must not wait on the network beyond its
    budget. With the server's L2 lookups held, a new request's lookup is
    deferred (None: asked again next step) instead of waiting for the answer,
    and asking again does not wait either; once the answer is in, the request
    gets it (a miss here: the L2 has nothing)."""
    side = connected_side(gated.address, lookup_wait_s=0.05)
    try:
        req = request("slow", prompt(700, seed=9))
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # waited 50 ms at most
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # still held: no wait
        gated.gate.set()
        answer = wait_for(
            lambda: side.get_num_new_matched_tokens(req, 0), lambda a: a[0] is not None
        )
        assert answer == (0, False)
        side.request_finished(req, [])
        assert side.timer.total_steps == 0  # no step was built: nothing was timed per step
    finally:
        side.close()


def test_a_new_tenants_first_request_waits_for_its_hello_and_is_stored(
    gated: Gated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of a tenant not seen before makes that tenant's client,
    whose HELLO may be answered after the lookup budget (a busy node). The
    request is deferred (None: asked again next step) until the answer is
    in, then looked up and stored like any other, instead of running
    without the cache and leaving the tenant's first prompt unstored."""
    side = connected_side(gated.address, lookup_wait_s=0.05)
    answer_hello = threading.Event()
    hello = gated.core._hello

    def late_hello(peer: bytes, connection: str, request: p.Hello) -> p.Reply:
        if request.salt == "new-tenant":
            assert answer_hello.wait(30), "the test never answered the HELLO"
        return hello(peer, connection, request)

    monkeypatch.setattr(gated.core, "_hello", late_hello)
    gated.gate.set()  # L2 lookups are answered at once (the mock L2 is empty)
    try:
        tokens = prompt(700, seed=50)
        req = request("first", tokens, salt="new-tenant")
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # its HELLO is out
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # still: no wait
        answer_hello.set()
        answer = wait_for(
            lambda: side.get_num_new_matched_tokens(req, 0), lambda a: a[0] is not None
        )
        assert answer == (0, False)  # looked up: a miss
        side.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5, 6]), 0)
        step = parked_step()
        step.scheduled_new_reqs = [
            SimpleNamespace(req_id="first", block_ids=([1, 2, 3, 4, 5, 6],), num_computed_tokens=0)
        ]
        step.num_scheduled_tokens = {"first": 700}
        (store,) = side.build_connector_meta(step).stores
        assert (store.salt, store.hashes) == (
            "new-tenant",
            side.clients.hasher("new-tenant", CHUNK).chunk_hashes(tokens),
        )
        side.request_finished(req, [])
    finally:
        answer_hello.set()
        side.close()


def test_server_away_a_new_tenants_request_is_not_deferred() -> None:
    """With no client of the pool registered the server is taken to be away:
    a new tenant's request runs at once without the cache."""
    settings = ConnectorSettings(address="tcp://127.0.0.1:9", request_timeout_s=5)
    side = SchedulerSide(vllm_config(), settings)
    try:
        req = request("x", prompt(700), salt="new-tenant")
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert side.clients._clients["new-tenant"].registering  # its HELLO is still out
    finally:
        side.close()


def test_while_answers_come_late_new_lookups_do_not_wait(
    gated: Gated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for an answer that comes after the budget only loses the
    budget: once lookups have been answered late, new ones are sent without
    blocking (the request is deferred at once), but for one in PROBE_EVERY."""
    side = connected_side(gated.address, lookup_wait_s=0.05)
    try:
        client = side.clients.client("")
        assert client is not None
        blocks: list[float | None] = []
        chose: list[bool] = []  # per new lookup: whether it was to wait
        lookup, worth_waiting = client.lookup, side._worth_waiting

        def spied(*args: Any, **kwargs: Any) -> Any:
            blocks.append(kwargs.get("block_s"))
            return lookup(*args, **kwargs)

        def deciding() -> bool:
            chose.append(worth_waiting())
            return chose[-1]

        monkeypatch.setattr(client, "lookup", spied)
        monkeypatch.setattr(side, "_worth_waiting", deciding)
        late = request("late", prompt(700, seed=30))
        assert side.get_num_new_matched_tokens(late, 0) == (None, False)  # no answer in 50 ms
        gated.gate.set()
        wait_for(lambda: side.get_num_new_matched_tokens(late, 0), lambda a: a[0] is not None)
        side.request_finished(late, [])
        gated.gate.clear()
        side.build_connector_meta(parked_step())  # the next step: a fresh budget
        later = [request(f"r{i}", prompt(700, seed=31 + i)) for i in range(PROBE_EVERY)]
        for req in later:
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert blocks[0] == 0.05  # no answer times yet: the first lookup waits
        # Lookups 2..PROBE_EVERY + 1: only the PROBE_EVERY-th is to wait (for what is left of
        # the step's budget, which a loaded machine may have spent on the lookups before it).
        waited = [n for n, wait in enumerate(chose, start=1) if wait]
        assert waited == [1, PROBE_EVERY]
        assert all(not block for block, wait in zip(blocks, chose, strict=True) if not wait)
    finally:
        gated.gate.set()
        side.close()


def test_shadow_sampled_request_computes_its_last_hit_chunk_and_counts_outcomes(
    server: Server,
) -> None:
    settings = ConnectorSettings(address=server.rpc, lookup_wait_s=10.0, shadow_fraction=1.0)
    side = SchedulerSide(vllm_config(), settings)
    try:
        tokens = prompt(700, seed=11)
        assert store_chunks(side, tokens) == 2
        req = request("shadowed", tokens)
        # The hit is chunks 0 and 1; chunk 1 is left to vLLM for the check.
        assert side.get_num_new_matched_tokens(req, 0) == (256, False)
        assert side.get_num_new_matched_tokens(req, 0) == (256, False)  # a stable decision
        side.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14, 15]), 256)
        meta = side.build_connector_meta(
            SimpleNamespace(
                scheduled_new_reqs=[
                    SimpleNamespace(
                        req_id="shadowed",
                        block_ids=([10, 11, 12, 13, 14, 15],),
                        num_computed_tokens=256,
                    )
                ],
                scheduled_cached_reqs=SimpleNamespace(
                    req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
                ),
                num_scheduled_tokens={"shadowed": 444},
            )
        )
        (load,) = meta.loads
        assert (load.first_chunk, load.blocks) == (0, [[{0: 10, 1: 11}]])
        assert meta.stores == []  # chunk 1 is in kvtier already: compared, not stored
        (check,) = meta.shadows
        hashes = side.clients.hasher("", CHUNK).chunk_hashes(tokens)
        assert (check.chunk, check.hash, check.block_ids) == (1, hashes[1], [[12, 13]])
        side.update_connector_output(None)
        side.request_finished(req, [])
        assert wait_for(lambda: held(side), lambda n: n == 0) == 0

        miss = request("cold", prompt(700, seed=12))
        assert side.get_num_new_matched_tokens(miss, 0) == (0, False)
        side.request_finished(miss, [])
        assert side.outcomes.snapshot() == {"hit": 1, "not_found": 1}
    finally:
        side.close()


def parked_step() -> Any:
    """A scheduler output in which no request runs (an asynchronous load's
    request waits for its KV)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={},
    )


@pytest.fixture
def async_side(server: Server) -> Any:
    settings = ConnectorSettings(address=server.rpc, lookup_wait_s=10.0, load_async=True)
    scheduler = SchedulerSide(vllm_config(), settings)
    yield scheduler
    scheduler.close()


def stored_request(side: SchedulerSide, request_id: str, n: int, seed: int) -> Any:
    """A request of ``n`` tokens whose two full chunks kvtier holds."""
    tokens = prompt(n, seed=seed)
    assert store_chunks(side, tokens) == 2
    return request(request_id, tokens)


def test_an_asynchronous_load_keeps_its_chunks_locked_until_the_workers_finish_it(
    async_side: SchedulerSide, server: Server
) -> None:
    side = async_side
    req = stored_request(side, "async", 700, seed=13)
    assert side.get_num_new_matched_tokens(req, 0) == (512, True)
    assert side.get_num_new_matched_tokens(req, 128) == (384, True)  # the same lookup
    side.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14, 15]), 384)
    (load,) = side.build_connector_meta(parked_step()).loads
    assert load.asynchronous
    assert (load.first_chunk, load.blocks) == (0, [[{1: 11}], [{0: 12, 1: 13}]])
    side.update_connector_output(SimpleNamespace(finished_recving=None))  # the load step is back
    side.update_connector_output(SimpleNamespace(finished_recving={"other"}))
    assert held(side) == 2  # the workers are still copying
    side.update_connector_output(SimpleNamespace(finished_recving={"async"}))
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0
    # vLLM asks again after the load only when it failed whole (it freed the
    # blocks): the request is then offered nothing and computes its prompt.
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, Blocks([20, 21, 22, 23, 24, 25]), 0)
    side.request_finished(req, [])
    assert held(side) == 0


def test_a_request_aborted_while_its_load_runs_releases_everything(
    async_side: SchedulerSide, server: Server
) -> None:
    side = async_side
    req = stored_request(side, "aborted", 600, seed=14)
    assert side.get_num_new_matched_tokens(req, 0) == (512, True)
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 512)
    assert len(side.build_connector_meta(parked_step()).loads) == 1
    side.request_finished(req, [])  # aborted: vLLM keeps its blocks until the load is done
    assert wait_for(lambda: held(side), lambda n: n == 0) == 0
    side.update_connector_output(SimpleNamespace(finished_recving={"aborted"}))  # then reported
    assert held(side) == 0


def test_a_miss_is_never_an_asynchronous_load(async_side: SchedulerSide) -> None:
    req = request("cold", prompt(700, seed=15))
    assert async_side.get_num_new_matched_tokens(req, 0) == (0, False)
    async_side.request_finished(req, [])
