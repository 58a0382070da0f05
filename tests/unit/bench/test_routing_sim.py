"""The multi-tenant trace and the routing simulator, on cases small enough to
work out by hand."""

from __future__ import annotations

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
