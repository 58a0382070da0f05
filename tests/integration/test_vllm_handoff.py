"""The connector's prefill/decode hand-off (``kvtier.engine.vllm.handoff``) at
the scheduler seam, against a real cache server: a producer's stores and
offer, a consumer's take and asynchronous load, and each way a hand-off can
fail ending with the request's policy and nothing left held."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from tests.integration.harness import Server, ServerFactory, wait_for
from tests.servers import RedisProcess

pytest.importorskip("vllm")
from kvtier.engine.vllm.scheduler import SchedulerSide
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.protocol.handoff import (
    CAUSE,
    HANDOFF_ID,
    OUTCOME,
    PAGES,
    PROMPT_TOKENS,
    RANKS,
    SERVER,
)
from tests.integration.test_vllm_scheduler import (
    CHUNK,
    Blocks,
    parked_step,
    prompt,
    store_objects,
    vllm_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # needs vLLM

PROMPT = 600  # two full chunks (four blocks) and a tail of 88 tokens (one block)


def side_for(address: str, tp: int = 1, **settings: Any) -> SchedulerSide:
    options = {"lookup_wait_s": 10.0, "handoff_wait_s": 5.0, **settings}
    side = SchedulerSide(vllm_config(tp), ConnectorSettings(address=address, **options))
    wait_for(lambda: side.clients.client(""), lambda client: client is not None)
    return side


def pd_request(request_id: str, tokens: list[int], params: dict[str, Any] | None) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        num_preemptions=0,
        cache_salt=None,
        kv_transfer_params=params,
    )


def prefill_step(request_id: str, blocks: list[int], tokens: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=request_id, block_ids=(blocks,), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={request_id: tokens},
    )


def produce(side: SchedulerSide, tokens: list[int], store: bool = True) -> dict[str, Any] | None:
    """Run a producer's request through its prefill step and finish it (the
    offer): its hand-off's parameters."""
    req = prefill(side, tokens, store)
    _, params = side.request_finished(req, [10, 11, 12, 13, 14])
    return params


def prefill(side: SchedulerSide, tokens: list[int], store: bool = True) -> Any:
    """A producer's request through its prefill step; its worker stores what
    the step asks (unless ``store`` is False: the stores failed)."""
    req = pd_request("p", tokens, {"do_remote_decode": True})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14]), 0)
    meta = side.build_connector_meta(prefill_step("p", [10, 11, 12, 13, 14], len(tokens)))
    full, tail = meta.stores
    assert full.block_ids == [[10, 11, 12, 13]]
    assert tail.block_ids == [[14, 14]]  # one block of tail, padded to the chunk's two
    if store:
        assert store_objects(side, full.hashes + tail.hashes) == 3
    return req


def handed_off(producer: SchedulerSide, seed: int) -> tuple[list[int], dict[str, Any]]:
    """A fresh prompt through the producer: its tokens and its hand-off's parameters."""
    tokens = prompt(PROMPT, seed=seed)
    params = produce(producer, tokens)
    assert params is not None
    return tokens, params


def status(side: SchedulerSide) -> dict[str, Any]:
    """The server's live status, as JSON would have it (whole sections compare)."""
    client = side.clients.client("")
    assert client is not None
    answer = client.status()
    assert answer is not None
    as_json: dict[str, Any] = msgspec.to_builtins(answer)
    return as_json


def consumer_request(tokens: list[int], params: dict[str, Any], rid: str = "d") -> Any:
    return pd_request(rid, [*tokens, 7], params)  # the producer's first token follows


def take_and_load(
    consumer: SchedulerSide, req: Any, blocks: list[int], load_async: bool = False
) -> Any:
    """A consumer's first steps: the take, granted and offered whole (every
    prompt token), then its load's step (two chunks and the tail): the load."""
    answer = wait_for(
        lambda: consumer.get_num_new_matched_tokens(req, 0), lambda a: a[0] is not None
    )
    assert answer == (PROMPT, load_async)
    consumer.update_state_after_alloc(req, Blocks(blocks), PROMPT)
    (load,) = consumer.build_connector_meta(parked_step()).loads
    assert len(load.hashes) == 3 and not load.failed
    return load


@pytest.mark.parametrize("load_async", [False, True])
def test_a_hand_off_goes_from_producer_to_consumer_and_is_released(
    server: Server, load_async: bool
) -> None:
    """Loaded like any hit: before the step's forward, or (``load_async``)
    on the worker's load thread while the request waits for remote KV."""
    producer, consumer = side_for(server.rpc), side_for(server.rpc, load_async=load_async)
    try:
        tokens = prompt(PROMPT, seed=40)
        params = produce(producer, tokens)
        assert params is not None and params[PROMPT_TOKENS] == PROMPT
        req = consumer_request(tokens, params)
        load = take_and_load(consumer, req, [30, 31, 32, 33, 34], load_async)
        assert load.asynchronous == load_async
        assert load.blocks == [[{0: 30, 1: 31}], [{0: 32, 1: 33}], [{0: 34}]]
        assert status(consumer)["handoffs"]["held"] == 1
        # The load's step came back (or the workers report the asynchronous load done).
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        assert wait_for(lambda: status(consumer)["handoffs"]["held"], lambda n: n == 0) == 0
        _, outcome = consumer.request_finished(req, [30, 31, 32, 33, 34])
        assert outcome == {HANDOFF_ID: params[HANDOFF_ID], OUTCOME: "loaded"}
        server_counts = status(consumer)["server"]["handoffs"]
        assert server_counts["offered"] == server_counts["consumed"] == 1
        assert status(consumer)["storage"]["held_lookup_locks"] == 0
    finally:
        producer.close()
        consumer.close()


def test_an_offer_made_while_the_server_is_quiet_is_sent_when_it_answers(
    server: Server,
) -> None:
    """The finding (a CI run of test_vllm_pd): the server went quiet past the
    producer's request timeout, so its connection was down when the request
    finished; the offer was answered with nothing at once and never sent,
    yet the producer handed the proxy its hand-off, and the consumer
    recomputed after waiting ``handoff_wait_s`` for it. The offer is held
    now, and sent once the server answers: the consumer loads it."""
    producer = side_for(server.rpc, lookup_wait_s=0.2, request_timeout_s=0.5)
    consumer = side_for(server.rpc)
    try:
        tokens = prompt(PROMPT, seed=46)
        req = prefill(producer, tokens)
        client = producer.clients.client("")
        assert client is not None
        with server.stalled():
            assert client.ping() is False and client.degraded
            _, params = producer.request_finished(req, [10, 11, 12, 13, 14])
        assert params is not None and params[PROMPT_TOKENS] == PROMPT
        assert producer.outcomes.snapshot()["handoff_offered"] == 1
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [30, 31, 32, 33, 34])
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        _, outcome = consumer.request_finished(req, [30, 31, 32, 33, 34])
        assert outcome == {HANDOFF_ID: params[HANDOFF_ID], OUTCOME: "loaded"}
    finally:
        producer.close()
        consumer.close()


def test_a_hand_off_never_offered_ends_with_the_policy(server: Server) -> None:
    """The producer died before its offer: the consumer waits handoff_wait_s
    (deferred, never blocking), then recomputes, or fails the request."""
    tokens = prompt(PROMPT, seed=41)
    params = {"do_remote_prefill": True, HANDOFF_ID: "never", PROMPT_TOKENS: PROMPT}
    for policy in ("recompute", "error"):
        consumer = side_for(server.rpc, handoff_wait_s=0.3, handoff_failure=policy)
        try:
            req = consumer_request(tokens, params, rid=policy)
            assert consumer.get_num_new_matched_tokens(req, 0) == (None, False)
            answer = wait_for(
                lambda req=req, side=consumer: side.get_num_new_matched_tokens(req, 0),
                lambda a: a[0] is not None,
            )
            if policy == "recompute":
                assert answer == (0, False)
            else:  # a load that fails every block: vLLM (kv_load_failure_policy fail) errors it
                assert answer == (PROMPT, False)
                consumer.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), PROMPT)
                (load,) = consumer.build_connector_meta(parked_step()).loads
                assert load.failed and load.blocks == [[{0: 1, 1: 2, 2: 3, 3: 4, 4: 5}]]
            _, outcome = consumer.request_finished(req, [])
            expected = "recomputed" if policy == "recompute" else "error"
            assert outcome == {HANDOFF_ID: "never", OUTCOME: expected, CAUSE: "not_offered"}
            assert consumer.outcomes.snapshot()[f"handoff_{policy}.not_offered"] == 1
        finally:
            consumer.close()


def test_a_request_can_choose_its_own_policy(server: Server) -> None:
    consumer = side_for(server.rpc, handoff_wait_s=0.1)  # the deployment recomputes
    try:
        tokens = prompt(PROMPT, seed=42)
        params = {"do_remote_prefill": True, HANDOFF_ID: "gone", PROMPT_TOKENS: PROMPT}
        req = consumer_request(tokens, {**params, "kvtier_on_failure": "error"})
        answer = wait_for(
            lambda: consumer.get_num_new_matched_tokens(req, 0), lambda a: a[0] is not None
        )
        assert answer == (PROMPT, False)  # the request asked for an error
        consumer.request_finished(req, [])
    finally:
        consumer.close()


def test_two_consumers_racing_for_one_hand_off(server: Server) -> None:
    producer, first, second = (side_for(server.rpc) for _ in range(3))
    try:
        tokens, params = handed_off(producer, seed=43)
        a, b = consumer_request(tokens, params, "a"), consumer_request(tokens, params, "b")
        got_a = wait_for(lambda: first.get_num_new_matched_tokens(a, 0), lambda x: x[0] is not None)
        got_b = wait_for(
            lambda: second.get_num_new_matched_tokens(b, 0), lambda x: x[0] is not None
        )
        assert got_a == (PROMPT, False) and got_b == (0, False)  # the loser recomputes
        _, lost = second.request_finished(b, [])
        assert lost is not None and lost[CAUSE] == "taken"
        first.update_state_after_alloc(a, Blocks([1, 2, 3, 4, 5]), PROMPT)
        first.build_connector_meta(parked_step())
        _, won = first.request_finished(a, [])  # aborted mid-load: the hold is dropped now
        assert won is not None and won[OUTCOME] == "recomputed"
        assert wait_for(lambda: status(first)["handoffs"]["held"], lambda n: n == 0) == 0
        assert (
            wait_for(lambda: status(first)["storage"]["held_lookup_locks"], lambda n: n == 0) == 0
        )
    finally:
        for side in (producer, first, second):
            side.close()


def test_an_expired_hand_off_is_recomputed_and_an_incomplete_one_never_offered(
    server: Server,
) -> None:
    producer = side_for(server.rpc, handoff_lease_s=0.2)
    consumer = side_for(server.rpc)
    try:
        tokens, params = handed_off(producer, seed=44)
        # The decode engine is late: the lease ends first (the server's tick reclaims it).
        assert wait_for(lambda: status(producer)["handoffs"]["held"], lambda n: n == 0) == 0
        req = consumer_request(tokens, params)
        answer = wait_for(
            lambda: consumer.get_num_new_matched_tokens(req, 0),
            lambda a: a[0] is not None,
            timeout_s=5,
        )
        assert answer == (0, False)
        _, outcome = consumer.request_finished(req, [])
        assert outcome is not None and outcome[CAUSE] == "expired"
        # A producer whose stores did not land learns it from the server's answer
        # to its offer (incomplete): its response names no hand-off, and the proxy
        # applies the policy without asking a decode engine to wait.
        assert produce(producer, prompt(PROMPT, seed=45), store=False) is None
        assert producer.outcomes.snapshot()["handoff_not_offered"] == 1
        assert status(producer)["server"]["handoffs"]["incomplete"] == 1
        assert status(consumer)["storage"]["held_lookup_locks"] == 0
    finally:
        producer.close()
        consumer.close()


def test_bad_hand_off_parameters_and_an_absent_server_are_policy_outcomes(
    server: Server,
) -> None:
    consumer = side_for(server.rpc)
    try:
        tokens = prompt(PROMPT, seed=46)
        base = {"do_remote_prefill": True, HANDOFF_ID: "x", PROMPT_TOKENS: PROMPT}
        for n, bad in enumerate(({**base, PROMPT_TOKENS: PROMPT + 5}, {**base, PAGES: 5})):
            req = consumer_request(tokens, bad, rid=f"bad{n}")
            assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
            _, outcome = consumer.request_finished(req, [])
            assert outcome is not None and outcome[CAUSE] == "bad_params"
    finally:
        consumer.close()
    away = SchedulerSide(
        vllm_config(), ConnectorSettings(address="tcp://127.0.0.1:9", lookup_wait_s=0.05)
    )
    try:
        params = {"do_remote_prefill": True, HANDOFF_ID: "x", PROMPT_TOKENS: PROMPT}
        req = consumer_request(prompt(PROMPT, seed=47), params)
        assert away.get_num_new_matched_tokens(req, 0) == (0, False)
        _, outcome = away.request_finished(req, [])
        assert outcome is not None and outcome[CAUSE] == "server_away"
        producer_req = pd_request("p", prompt(PROMPT, seed=47), {"do_remote_decode": True})
        assert away.get_num_new_matched_tokens(producer_req, 0) == (0, False)
        assert away.request_finished(producer_req, []) == (False, None)  # nothing to offer
    finally:
        away.close()


def test_the_hand_off_outlives_its_producer(server: Server) -> None:
    """The prefill engine dies once vLLM has finished its request: its KV is
    the server's, and the decode engine still loads it."""
    producer, consumer = side_for(server.rpc), side_for(server.rpc)
    try:
        tokens, params = handed_off(producer, seed=50)
        wait_for(lambda: status(consumer)["handoffs"]["held"], lambda n: n == 1)
        producer.close()  # its connections go; the hold stays
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [1, 2, 3, 4, 5])
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        _, outcome = consumer.request_finished(req, [])
        assert outcome is not None and outcome[OUTCOME] == "loaded"
        assert wait_for(lambda: status(consumer)["handoffs"]["held"], lambda n: n == 0) == 0
    finally:
        consumer.close()


def test_a_consumer_that_dies_after_taking_is_reclaimed_by_the_lease(
    kvtier_server: ServerFactory,
) -> None:
    """Its hold ends with the lease; its lookup's locks with its client's
    time-to-live (short here): the ledger ends at zero."""
    server = kvtier_server.start("--set", "limits.client_ttl_s=2")
    producer, consumer = side_for(server.rpc, handoff_lease_s=3.0), side_for(server.rpc)
    try:
        tokens, params = handed_off(producer, seed=51)
        take_and_load(consumer, consumer_request(tokens, params), [1, 2, 3, 4, 5])
        consumer.close()  # dies mid-load: no DONE
        held = 3 * producer.clients.layout(CHUNK).object_bytes()  # two chunks and the tail
        assert status(producer)["handoffs"] == {"held": 1, "held_bytes": held, "taken": 1}
        assert wait_for(lambda: status(producer)["handoffs"]["held"], lambda n: n == 0) == 0
        assert status(producer)["server"]["handoffs"]["expired"] == 1
        assert (
            wait_for(lambda: status(producer)["storage"]["held_lookup_locks"], lambda n: n == 0)
            == 0
        )
    finally:
        producer.close()


def test_the_cache_server_killed_mid_hand_off(kvtier_server: ServerFactory) -> None:
    """Killed after the offer: the decode engine's take finds no server (a
    recompute); restarted, the new server never heard of the hand-off and
    has no tier it could find the chunks in (L1 only: a restart that keeps
    them on disk is ``test_vllm_pd.py``'s last test), and the wait for it
    ends as the producer's death would."""
    first = kvtier_server.start("--cache-dir", "none")
    producer = side_for(first.rpc)
    consumer = side_for(first.rpc, handoff_wait_s=1.0, request_timeout_s=0.5)
    try:
        tokens, params = handed_off(producer, seed=52)
        wait_for(lambda: status(consumer)["handoffs"]["held"], lambda n: n == 1)
        second = kvtier_server.restart(first, "--cache-dir", "none")
        req = consumer_request(tokens, params)
        answer = wait_for(
            lambda: consumer.get_num_new_matched_tokens(req, 0), lambda a: a[0] is not None
        )
        assert answer == (0, False)
        _, outcome = consumer.request_finished(req, [])
        assert outcome is not None and outcome[CAUSE] in ("server_away", "not_offered")
        wait_for(lambda: consumer.clients.client(""), lambda client: client is not None)
        later = consumer_request(tokens, params, "d2")
        answer = wait_for(
            lambda: consumer.get_num_new_matched_tokens(later, 0), lambda a: a[0] is not None
        )
        assert answer == (0, False)
        _, outcome = consumer.request_finished(later, [])
        assert outcome is not None and outcome[CAUSE] == "not_offered"
        assert second.status()["handoffs"]["held"] == 0
    finally:
        producer.close()
        consumer.close()


def test_a_consumer_that_has_not_heard_of_the_restart_finds_the_hand_off_on_disk(
    kvtier_server: ServerFactory,
) -> None:
    """The cache server is killed after the offer and its chunks' write-back
    to its disk tier, and restarted on both. The consumer's client learns of
    the restart only when it next hears from the server (its heartbeat is
    10 s away): its first take goes out as if nothing happened, is answered
    ``pending`` (the new server never heard of the hand-off), and the next
    take asks the new server to find the chunks on disk. It gets them, well
    within its wait."""
    first = kvtier_server.start()
    producer = side_for(first.rpc)
    try:
        tokens, params = handed_off(producer, seed=54)
        stored = wait_for(
            partial(status, producer),
            lambda s: s["storage"]["store"]["stored_objects"].get("fs", 0) >= 3,
        )
        assert stored["storage"]["store"]["stored_objects"]["fs"] == 3  # two chunks and the tail
    finally:
        producer.close()
    consumer = side_for(first.rpc)  # registered with the producer's server
    try:
        second = kvtier_server.restart(first)
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [30, 31, 32, 33, 34])
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        _, outcome = consumer.request_finished(req, [30, 31, 32, 33, 34])
        assert outcome == {HANDOFF_ID: params[HANDOFF_ID], OUTCOME: "loaded"}
        seen = wait_for(second.status, lambda s: s["server"]["handoffs"]["consumed"] == 1)
        assert seen["server"]["handoffs"]["found"] == seen["server"]["handoffs"]["consumed"] == 1
        assert seen["handoffs"]["held"] == 0
    finally:
        consumer.close()


def test_a_preempted_consumer_reloads_its_prompt_without_taking_again(server: Server) -> None:
    producer = side_for(server.rpc)
    consumer = side_for(server.rpc, handoff_failure="error")
    try:
        tokens, params = handed_off(producer, seed=53)
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [1, 2, 3, 4, 5])
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        preempted = consumer_request(tokens, params)
        preempted.num_preemptions = 1  # its blocks were freed: vLLM asks again
        answer = wait_for(
            lambda: consumer.get_num_new_matched_tokens(preempted, 0), lambda a: a[0] is not None
        )
        assert answer == (PROMPT, False)  # its chunks, looked up as a prefix: no second TAKE
        consumer.update_state_after_alloc(preempted, Blocks([6, 7, 8, 9, 10]), PROMPT)
        (load,) = consumer.build_connector_meta(parked_step()).loads
        assert not load.failed and len(load.hashes) == 3
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        consumer.request_finished(preempted, [])
        counters = status(consumer)["server"]["handoffs"]
        assert counters["taken"] == counters["consumed"] == 1
        assert (
            wait_for(lambda: status(consumer)["storage"]["held_lookup_locks"], lambda n: n == 0)
            == 0
        )
    finally:
        producer.close()
        consumer.close()


def test_a_producer_preempted_mid_prefill_still_hands_off_its_whole_prompt(
    server: Server,
) -> None:
    producer, consumer = side_for(server.rpc), side_for(server.rpc)
    try:
        tokens = prompt(PROMPT, seed=54)
        req = pd_request("p", tokens, {"do_remote_decode": True})
        assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
        producer.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14]), 0)
        step = producer.build_connector_meta(prefill_step("p", [10, 11, 12, 13, 14], 256))
        (first,) = step.stores  # chunk 0 only: its prefill was cut after 256 tokens
        assert store_objects(producer, first.hashes) == 1
        req.num_preemptions = 1  # preempted: its blocks freed, asked again
        assert producer.get_num_new_matched_tokens(req, 0) == (256, False)  # its own chunk
        producer.update_state_after_alloc(req, Blocks([20, 21, 22, 23, 24]), 256)
        resumed = SimpleNamespace(  # as vLLM reports a resumed request
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["p"],
                resumed_req_ids={"p"},
                new_block_ids=[([20, 21, 22, 23, 24],)],
                num_computed_tokens=[256],
            ),
            num_scheduled_tokens={"p": PROMPT - 256},
        )
        rest, tail = producer.build_connector_meta(resumed).stores
        assert rest.block_ids == [[22, 23]] and tail.block_ids == [[24, 24]]
        assert store_objects(producer, rest.hashes + tail.hashes) == 2
        _, params = producer.request_finished(req, [])
        assert params is not None
        take_and_load(consumer, consumer_request(tokens, params), [1, 2, 3, 4, 5])
        consumer.update_connector_output(SimpleNamespace(finished_recving=None))
        _, outcome = consumer.request_finished(consumer_request(tokens, params), [])
        assert outcome is not None and outcome[OUTCOME] == "loaded"
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize(
    ("finish", "outcome"),
    [("FINISHED_LENGTH_CAPPED", "loaded"), ("FINISHED_ABORTED", "recomputed")],
)
def test_a_decode_finished_by_its_load_step_reports_how_its_hand_off_went(
    server: Server, finish: str, outcome: str
) -> None:
    """A one-token decode finishes in the step that loads its prompt, before
    that step's connector output comes back: it ran on the loaded KV if vLLM
    finished it normally, not if it was aborted first."""
    producer, consumer = side_for(server.rpc), side_for(server.rpc)
    try:
        tokens, params = handed_off(producer, seed=55)
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [1, 2, 3, 4, 5])
        req.status = SimpleNamespace(name=finish)
        _, said = consumer.request_finished(req, [])
        assert said is not None and said[OUTCOME] == outcome
        consumer.update_connector_output(SimpleNamespace(finished_recving=None))  # then its step
        held = wait_for(lambda: handoffs_held(consumer), lambda n: n == 0)
        assert held == 0
    finally:
        producer.close()
        consumer.close()


def handoffs_held(side: SchedulerSide) -> int:
    return int(status(side)["handoffs"]["held"])


def test_a_consumer_of_another_tp_size_is_given_its_own_rank_split(server: Server) -> None:
    """A TP 1 producer, a TP 2 consumer: the take names the prompt under both
    layouts, the server re-shards the three chunks into two ranks each, and
    the consumer loads them like its own; a TP size that cannot split the
    model's heads is refused and recomputed."""
    producer, consumer = side_for(server.rpc), side_for(server.rpc, tp=2)
    try:
        tokens, params = handed_off(producer, seed=60)
        assert params[RANKS] == 1
        assert params[PAGES] == producer.clients.layout(CHUNK).format  # e.g. vllm-cpu-vec-bs16
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [30, 31, 32, 33, 34])
        assert status(consumer)["server"]["handoffs"]["resharded"] == 1
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        _, outcome = consumer.request_finished(req, [30, 31, 32, 33, 34])
        assert outcome == {HANDOFF_ID: params[HANDOFF_ID], OUTCOME: "loaded"}
        # The producer said TP 3, which cannot split 2 KV heads: never loaded.
        tokens, params = handed_off(producer, seed=61)
        req = consumer_request(tokens, {**params, RANKS: 3}, rid="d3")
        assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
        _, outcome = consumer.request_finished(req, [])
        assert outcome is not None and outcome[CAUSE] == "layout_mismatch"
        held = wait_for(lambda: status(consumer), lambda s: s["handoffs"]["held"] == 1)
        assert held["handoffs"]["held"] == 1  # the second, left to its lease
        assert held["storage"]["held_lookup_locks"] == 0
    finally:
        producer.close()
        consumer.close()


def test_a_hand_off_across_nodes_is_found_through_the_shared_l2(
    kvtier_server: ServerFactory, redis_server: RedisProcess
) -> None:
    """The producer's cache server (node A) is not the consumer's (node B);
    both write back to one real Redis. The consumer's take asks B to find
    the chunks there: pending while A's write-back is on its way, then B
    holds them for it; it loads them and B's hold ends with its DONE."""
    shared = json.dumps({"type": "redis", "url": redis_server.url, "name": "shared"})
    node_a, node_b = (kvtier_server.start("--cache-dir", "none", "--l2", shared) for _ in "ab")
    producer = side_for(node_a.rpc, handoff_lease_s=1.0)  # A's own hold: until written back
    consumer = side_for(node_b.rpc)
    try:
        tokens, params = handed_off(producer, seed=70)
        assert params[SERVER] == status(producer)["boot_id"] != status(consumer)["boot_id"]
        req = consumer_request(tokens, params)
        take_and_load(consumer, req, [30, 31, 32, 33, 34])
        found = status(consumer)
        assert found["server"]["handoffs"]["found"] == 1
        assert found["handoffs"]["held"] == 1
        consumer.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        _, outcome = consumer.request_finished(req, [30, 31, 32, 33, 34])
        assert outcome == {HANDOFF_ID: params[HANDOFF_ID], OUTCOME: "loaded"}
        for side in (consumer, producer):  # B's hold: DONE; A's: its lease
            after = wait_for(partial(status, side), lambda s: s["handoffs"]["held"] == 0)
            assert after["handoffs"]["held"] == 0
            assert after["storage"]["held_lookup_locks"] == 0
    finally:
        producer.close()
        consumer.close()
