"""The multi-tenant trace and the routing simulator, on cases small enough to
work out by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvtier.bench.simulate import ORACLE, SimConfig, SimCosts, simulate
from kvtier.bench.tenants import TenancySpec, tenant_trace
from kvtier.traces import TraceRequest

COSTS = SimCosts(
    prefill_s_per_token=1e-3, l1_s_per_token=1e-4, shared_s_per_token=5e-4, overhead_s=0.01
)


def test_the_tenant_trace_is_pure_and_keeps_tenants_apart() -> None:
    spec = TenancySpec(tenants=3, requests=40, seed=5)
    trace = tenant_trace(spec)
    assert trace == tenant_trace(spec)
    assert {r.tenant for r in trace} == {"tenant0", "tenant1", "tenant2"}
    systems: dict[str, tuple[int, ...]] = {}
    for r in trace:
        head = r.prompt[: spec.system_tokens]
        assert systems.setdefault(r.tenant, head) == head  # each tenant's own system prompt
    assert len(set(systems.values())) == 3
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    with pytest.raises(ValueError, match="--chat-share"):
        TenancySpec(chat_share=2)


def request(i: int, at: float, prompt: tuple[int, ...], tenant: str = "t") -> TraceRequest:
    return TraceRequest(f"r{i}", at, prompt, 1, tenant=tenant)


def test_a_repeat_goes_where_the_prefix_is_and_costs_what_it_should() -> None:
    prompt = tuple(range(512))
    trace = [request(0, 0.0, prompt), request(1, 10.0, prompt)]
    config = SimConfig(nodes=2, l1_chunks=8, engine_chunks=0, costs=COSTS)
    result = simulate(trace, config, "kvtier")
    assert result.routed == [1, 1] or result.routed == [2, 0]
    cold = 0.01 + 512 * 1e-3
    warm_l1 = 0.01 + 1 * 1e-3 + 511 * 1e-4  # all but the last token from L1
    assert result.ttft_s[0] == pytest.approx(cold)
    assert result.ttft_s[1] == pytest.approx(warm_l1)  # L1 beats the shared store
    assert result.routed == [2, 0]
    spread = simulate(trace, config, "round_robin")
    assert spread.routed == [1, 1]
    assert spread.ttft_s[1] == pytest.approx(0.01 + 1e-3 + 511 * 5e-4)  # from the shared store


def test_a_busy_node_loses_to_an_idle_one_with_the_shared_copy() -> None:
    prompt = tuple(range(512))
    other = tuple(range(1000, 1512))
    # r0 leaves prompt in node 0's L1 and the shared store; r1 (new) ties and goes to
    # node 0, busy for 0.52 s; r2 repeats r0 at once: waiting for node 0's L1 costs
    # more than loading the shared copy on idle node 1.
    trace = [request(0, 0.0, prompt), request(1, 1.0, other), request(2, 1.01, prompt)]
    exact = SimCosts(prefill_s_per_token=1e-3, l1_s_per_token=1e-4, shared_s_per_token=5e-4)
    config = SimConfig(nodes=2, l1_chunks=8, engine_chunks=0, costs=exact)
    result = simulate(trace, config, "kvtier")
    assert result.routed == [2, 1]
    assert result.ttft_s[2] == pytest.approx(1e-3 + 511 * 5e-4)
    assert result.tokens == {"prefill": 512 + 512 + 1, "redis": 511}


@pytest.mark.parametrize("pending_ttl_s", [30.0, 0.0])
def test_a_repeat_during_the_first_prefill_follows_the_credit(pending_ttl_s: float) -> None:
    """r1 repeats r0 while r0 is still prefilling on node 0 (nothing stored
    or announced yet). With the router's credit for routed chunks it queues
    behind r0 and, starting after it, loads from L1 (what a node holds is
    read when a request starts); without, it recomputes on idle node 1."""
    prompt = tuple(range(512))
    fast_l1 = SimCosts(
        prefill_s_per_token=1e-3, l1_s_per_token=1e-5, shared_s_per_token=None, overhead_s=0.01
    )
    config = SimConfig(
        nodes=2, l1_chunks=8, engine_chunks=0, costs=fast_l1, pending_ttl_s=pending_ttl_s
    )
    result = simulate([request(0, 0.0, prompt), request(1, 0.3, prompt)], config, "kvtier")
    cold = 0.01 + 512 * 1e-3
    if pending_ttl_s:
        assert result.routed == [2, 0]
        assert result.ttft_s[1] == pytest.approx(cold - 0.3 + 0.01 + 1e-3 + 511 * 1e-5)
        assert result.sources[1] == {"prefill": 1, "L1": 511}
    else:
        assert result.routed == [1, 1]
        assert result.ttft_s[1] == pytest.approx(cold)
    summary = result.summary(slo_s=0.5)
    assert summary["goodput"] == (0.5 if pending_ttl_s else 0.0)
    assert summary["computed_share"] == round(result.tokens["prefill"] / 1024, 3)


def test_the_oracle_knows_where_the_prefix_will_be() -> None:
    """With no credit for routed chunks the kvtier policy cannot see r0's
    prefix on node 0 yet; the oracle knows node 0 will hold it when r1
    starts, and that waiting for it beats recomputing on node 1."""
    prompt = tuple(range(512))
    fast_l1 = SimCosts(
        prefill_s_per_token=1e-3, l1_s_per_token=1e-5, shared_s_per_token=None, overhead_s=0.01
    )
    config = SimConfig(nodes=2, l1_chunks=8, engine_chunks=0, costs=fast_l1, pending_ttl_s=0.0)
    trace = [request(0, 0.0, prompt), request(1, 0.3, prompt)]
    assert simulate(trace, config, "kvtier").routed == [1, 1]
    oracle = simulate(trace, config, ORACLE)
    assert oracle.routed == [2, 0] and oracle.sources[1] == {"prefill": 1, "L1": 511}
    other = tuple(range(1000, 1512))  # a new prompt: the idle node, as anyone would
    assert simulate([request(0, 0.0, prompt), request(1, 0.3, other)], config, ORACLE).routed == [
        1,
        1,
    ]


def test_an_engine_batches_prefills_into_steps_of_its_token_budget() -> None:
    """r0 prefills alone (0 to 0.522 s); r1 and r2 arrive meanwhile. With a
    budget that holds both, the next step computes them together and both
    first tokens come at its end; with a budget of 600 that step takes r1's
    512 tokens and r2's first 88, the step after r2's other 424 (chunked
    prefill)."""
    trace = [
        request(0, 0.0, tuple(range(512))),
        request(1, 0.1, tuple(range(1000, 1512))),
        request(2, 0.1, tuple(range(2000, 2512))),
    ]
    costs = SimCosts(
        prefill_s_per_token=1e-3, l1_s_per_token=1e-4, shared_s_per_token=None, overhead_s=0.01
    )
    one = 0.01 + 0.512
    whole = SimConfig(nodes=1, l1_chunks=8, engine_chunks=0, costs=costs, step_tokens=2048)
    both = one + 0.01 + 1.024 - 0.1
    assert simulate(trace, whole, "kvtier").ttft_s == pytest.approx([one, both, both])
    chunked = SimConfig(nodes=1, l1_chunks=8, engine_chunks=0, costs=costs, step_tokens=600)
    second = one + 0.01 + 0.6
    assert simulate(trace, chunked, "kvtier").ttft_s == pytest.approx(
        [one, second - 0.1, second + 0.01 + 0.424 - 0.1]
    )


def test_loads_from_the_shared_store_queue_for_its_bandwidth() -> None:
    """r0 and r1 fill the store; r2 and r3 repeat them at once on both nodes
    (round robin), each loading 511 tokens: with the store's bandwidth at
    1000 tokens/s the second load waits for the first."""
    a, b = tuple(range(512)), tuple(range(1000, 1512))
    trace = [request(0, 0.0, a), request(1, 0.0, b), request(2, 5.0, b), request(3, 5.0, a)]
    costs = SimCosts(
        prefill_s_per_token=1e-3, l1_s_per_token=1e-4, shared_s_per_token=1e-4, overhead_s=0.0
    )
    free = SimConfig(nodes=2, l1_chunks=0, engine_chunks=0, costs=costs)
    result = simulate(trace, free, "round_robin")
    assert result.sources[2] == result.sources[3] == {"prefill": 1, "redis": 511}
    assert result.ttft_s[2:] == [pytest.approx(511 * 1e-4 + 1e-3)] * 2
    narrow = dataclasses.replace(costs, shared_tokens_per_s=1000.0)
    result = simulate(trace, dataclasses.replace(free, costs=narrow), "round_robin")
    assert result.ttft_s[2] == pytest.approx(0.511 + 1e-3)
    assert result.ttft_s[3] == pytest.approx(2 * 0.511 + 1e-3)


@pytest.mark.parametrize("max_running", [1, 2])
def test_decodes_share_the_steps_and_hold_their_seat(max_running: int) -> None:
    """r0 (3 output tokens) prefills alone, then decodes twice. With one seat
    r1 waits for both decode steps; with two, r1's prefill shares the first
    decode step."""
    trace = [
        TraceRequest("r0", 0.0, tuple(range(512)), 3),
        TraceRequest("r1", 0.1, tuple(range(1000, 1512)), 1),
    ]
    costs = SimCosts(
        prefill_s_per_token=1e-3,
        l1_s_per_token=1e-4,
        shared_s_per_token=None,
        overhead_s=0.01,
        decode_s_per_token=5e-3,
    )
    config = SimConfig(nodes=1, l1_chunks=8, engine_chunks=0, costs=costs, max_running=max_running)
    first = 0.01 + 0.512
    r1 = 2 * (0.01 + 5e-3) + 0.01 + 0.512 if max_running == 1 else 0.01 + 5e-3 + 0.512
    assert simulate(trace, config, "kvtier").ttft_s == pytest.approx([first, first + r1 - 0.1])


def spaced_trace(seed: int, count: int, gap_s: float) -> list[TraceRequest]:
    """``count`` prompts of 16-4,000 tokens (most short), nothing shared, one
    every ``gap_s`` seconds with jitter: many find their node idle."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        tokens = int(rng.choice([rng.integers(16, 500), rng.integers(500, 4000)], p=[0.6, 0.4]))
        start = 4000 * i  # prompts share no token
        out.append(
            request(
                i, i * gap_s * float(rng.uniform(0.5, 1.5)), tuple(range(start, start + tokens))
            )
        )
    return out


STEPPED = SimCosts(
    prefill_s_per_token=1e-4, l1_s_per_token=5e-6, shared_s_per_token=None, overhead_s=0.01
)


def test_a_node_twice_as_slow_is_learned_and_drawn_less() -> None:
    config = SimConfig(
        nodes=4,
        l1_chunks=64,
        engine_chunks=0,
        costs=STEPPED,
        chunk_size=16,
        step_tokens=1024,
        speeds=(1.0, 1.0, 1.0, 2.0),
    )
    result = simulate(spaced_trace(0, 800, 0.08), config, "kvtier")
    learned = result.learned["engines"]
    assert isinstance(learned, dict)
    for node, (fixed, per_token) in enumerate(result.truth):
        assert learned[str(node)]["per_token_s"] == pytest.approx(per_token, rel=0.1)
        assert learned[str(node)]["fixed_s"] == pytest.approx(fixed, rel=0.1)
    assert result.truth[3] == (0.02, 2e-4)
    assert result.routed[3] < min(result.routed[:3])


def test_identical_nodes_learn_the_truth_where_a_single_rate_drifts() -> None:
    trace = spaced_trace(1, 600, 0.05)
    config = SimConfig(
        nodes=4, l1_chunks=64, engine_chunks=0, costs=STEPPED, chunk_size=16, step_tokens=1024
    )
    fit = simulate(trace, config, "kvtier")
    assert fit.learned_error(min_samples=16)["per_token"] < 0.1  # type: ignore[operator]
    assert fit.learned_error(min_samples=16)["fixed"] < 0.1  # type: ignore[operator]
    single = simulate(trace, dataclasses.replace(config, estimator="single_rate"), "kvtier")
    assert single.learned_error(min_samples=16)["per_token"] > 0.3  # type: ignore[operator]


def test_unequal_settings_must_name_every_node() -> None:
    with pytest.raises(ValueError, match="speeds must give all 4 nodes"):
        SimConfig(nodes=4, l1_chunks=1, engine_chunks=0, costs=STEPPED, speeds=(1.0, 2.0))
    with pytest.raises(ValueError, match="positive"):
        SimConfig(nodes=2, l1_chunks=1, engine_chunks=0, costs=STEPPED, speeds=(1.0, 0.0))
