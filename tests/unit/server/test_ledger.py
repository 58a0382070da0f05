"""The savings ledger's arithmetic (``SavingsLedger``): saved seconds are the
tokens engines report loading, priced at what one more computed token costs
their engines (the per-token part of a fit over the forwards they report,
never a forward's time over its tokens); what lookups served is counted
apart and saves nothing."""

from __future__ import annotations

import random

import pytest

from kvtier.keys import NamespaceLabel
from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.server.limits import ServerLimits
from kvtier.storage import StorageManager
from kvtier.tenancy.ledger import SavingsLedger
from tests.conftest import FakeClock
from tests.unit.server.test_core import call, hello

NS = NamespaceLabel("llama", "acme")
FIXED, PER_TOKEN = 0.5, 0.01  # a forward: half a second, then 10 ms a token


def forward(tokens: int) -> tuple[float, int]:
    return FIXED + PER_TOKEN * tokens, tokens


def test_loads_are_priced_at_the_per_token_part_of_the_engines_forwards() -> None:
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 1024)  # lookups found 1,024 tokens
    ledger.reported("acme", NS, *forward(100), 0.0, 0)
    ledger.reported("acme", NS, *forward(1000), 0.0, 0)
    ledger.reported("acme", NS, *forward(400), 1.0, 100)  # an engine loaded 100 of them
    ledger.reported("acme", NS, 0.0, 0, 2.0, 40)  # another loaded 40, no forward to report
    (row,) = ledger.report()["namespaces"]
    assert row["prefill_s_per_token"] == pytest.approx(PER_TOKEN)
    assert row["prefill_fixed_s"] == pytest.approx(FIXED)
    assert row["rate_samples"] == 3
    # 1.4 s, where time over tokens (the 400-token forward: 11.25 ms) said 1.575 s
    assert row["saved_s"] == pytest.approx(140 * PER_TOKEN)
    assert row["loaded_tokens"] == 140 and row["load_s"] == 3.0
    assert row["net_s"] == pytest.approx(140 * PER_TOKEN - 3.0)
    totals = ledger.report()["tenants"]["acme"]
    assert totals["served_tokens"] == 1024 and totals["loaded_tokens"] == 140
    assert totals["saved_s"] == pytest.approx(1.4) and totals["load_s"] == 3.0


def test_a_vllm_like_engine_is_priced_within_five_percent() -> None:
    """Steps of 64-2,368 computed tokens at 20 ms a step and 0.33 ms a token,
    off by up to 5 %: the price is the 0.33 ms, not the steps' mean time
    over tokens."""
    rng = random.Random(4)
    ledger = SavingsLedger()
    per_step = []
    for _ in range(200):
        tokens = rng.randint(64, 2368)
        seconds = (0.020 + 0.33e-3 * tokens) * rng.uniform(0.95, 1.05)
        per_step.append(seconds / tokens)
        ledger.reported("acme", NS, seconds, tokens, 0.0, 0)
    ledger.reported("acme", NS, 0.0, 0, 0.1, 1000)
    (row,) = ledger.report()["namespaces"]
    assert row["saved_s"] == pytest.approx(1000 * 0.33e-3, rel=0.05)
    assert sum(per_step) / len(per_step) > 1.05 * 0.33e-3  # what time over tokens would say


def test_tokens_served_but_not_loaded_save_nothing() -> None:
    """vLLM held the prefix itself: its lookup found it, its reports loaded none."""
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 512)
    ledger.reported("acme", NS, *forward(64), 0.0, 0)
    (row,) = ledger.report()["namespaces"]
    assert row["saved_s"] == 0.0 and row["net_s"] == 0.0
    assert row["served_tokens"] == {"L1": 512} and row["loaded_tokens"] == 0


def test_loads_before_any_forward_wait_for_the_first() -> None:
    ledger = SavingsLedger()
    ledger.reported("acme", NS, 0.0, 0, 0.5, 64)  # no forward anywhere yet: unknown, not invented
    (row,) = ledger.report()["namespaces"]
    assert row["loaded_tokens"] == 64 and row["prefill_s_per_token"] is None
    assert row["saved_s"] is None and row["net_s"] is None
    assert row["load_s"] == 0.5 and row["rate_samples"] == 0

    ledger.reported("acme", NS, 2.0, 8, 0.0, 0)  # the first forward prices the waiting tokens
    assert ledger.report()["namespaces"][0]["saved_s"] == pytest.approx(64 * 0.25)
    ledger.reported("acme", NS, 0.0, 0, 0.5, 8)
    (row,) = ledger.report()["namespaces"]
    assert row["saved_s"] == pytest.approx(72 * 0.25) and row["net_s"] == pytest.approx(17.0)


def test_without_reported_forwards_the_default_prices_the_loads() -> None:
    ledger = SavingsLedger(default_prefill_s_per_token=0.125)
    ledger.reported("acme", NS, 0.0, 0, 0.25, 80)
    (row,) = ledger.report()["namespaces"]
    assert row["prefill_s_per_token"] == 0.125 and row["rate_samples"] == 0
    assert row["saved_s"] == 10.0 and row["net_s"] == 9.75
    assert ledger.measured_rate("acme", NS) is None


def test_rows_give_served_by_tier_and_loaded_saved_and_net_by_namespace() -> None:
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 256)
    ledger.served("acme", NS, "fs", 512)
    ledger.reported("acme", NS, 128.0, 256, 4.0, 256)  # one forward: 0.5 s a token, no fixed
    ledger.served("globex", NS, "L1", 256)  # no report: nothing loaded, nothing saved
    rows = {row["tenant"]: row for row in ledger.report()["namespaces"]}
    numbers = ("served_tokens", "loaded_tokens", "load_s", "saved_s", "net_s")
    assert {t: tuple(row[n] for n in numbers) for t, row in rows.items()} == {
        "acme": ({"L1": 256, "fs": 512}, 256, 4.0, 128.0, 124.0),
        "globex": ({"L1": 256}, 0, 0.0, 0.0, 0.0),
    }


def test_namespaces_past_the_row_limit_are_summed_under_other() -> None:
    """The ledger's rows are keyed by namespaces clients name: one client
    under 400 model names keeps at most the limit of rows, the rest summed
    under "(other)", every token and second still counted."""
    ledger = SavingsLedger(rows_per_tenant=8)
    for n in range(400):
        namespace = NamespaceLabel(f"m{n}", "acme")
        ledger.served("acme", namespace, "L1", 16)
        ledger.reported("acme", namespace, 2.0, 4, 0.25, 4)
    report = ledger.report()
    assert len(report["namespaces"]) == 8
    assert "(other)" in {row["namespace"] for row in report["namespaces"]}
    assert report["tenants"]["acme"] == {
        "served_tokens": 400 * 16,
        "loaded_tokens": 400 * 4,
        "saved_s": 400 * 4 * 0.5,
        "load_s": 400 * 0.25,
        "net_s": 400 * 4 * 0.5 - 400 * 0.25,
    }
    assert ledger.measured_rate("acme", NamespaceLabel("m399", "acme")) == 0.5
    assert ledger.measured_rate("acme", NamespaceLabel("m0", "acme")) is None  # folded


@pytest.fixture
def server(storage: StorageManager, clock: FakeClock) -> CacheServer:
    return CacheServer(storage, chunk_size=16, limits=ServerLimits(client_ttl_s=1000), clock=clock)


@pytest.mark.parametrize(
    ("report", "says"),
    [
        (p.UsageReport(float("nan"), 64, 0.0, 0), "prefill_s must be in [0, 1000000.0]"),
        (p.UsageReport(float("inf"), 64, 0.0, 0), "prefill_s must be"),
        (p.UsageReport(-1.0, 64, 0.0, 0), "prefill_s must be"),
        (p.UsageReport(0.1, -1, 0.0, 0), "computed_tokens must be in [0, 4294967296]"),
        (p.UsageReport(0.1, 1 << 40, 0.0, 0), "computed_tokens must be"),
        (p.UsageReport(0.1, 64, 1e9, 0), "load_s must be"),
        (p.UsageReport(0.1, 64, 0.0, -5), "loaded_tokens must be"),
    ],
)
def test_a_usage_report_out_of_range_is_refused_naming_the_field(
    server: CacheServer, report: p.UsageReport, says: str
) -> None:
    assert isinstance(hello(server, b"A"), p.Welcome)
    reply = call(server, b"A", report)
    assert isinstance(reply, p.Error) and reply.code == "bad_request"
    assert says in reply.message
    assert server.status().ledger == []  # nothing taught, nothing counted


def test_one_client_reporting_forwards_without_end_keeps_a_window(server: CacheServer) -> None:
    """A fit keeps the last 64 forwards whatever one client sends: 10,000
    reports cost a bounded table, and the price follows the latest ones."""
    assert isinstance(hello(server, b"A"), p.Welcome)
    for n in range(10_000):
        tokens = 100 + n % 900
        assert call(server, b"A", p.UsageReport(0.01 + 1e-3 * tokens, tokens, 0.0, 0)) == p.Ack()
    (entry,) = server.status().ledger
    assert entry.forwards == 10_000
    assert entry.prefill_seconds_per_token == pytest.approx(1e-3)
    assert entry.prefill_fixed_seconds == pytest.approx(0.01)
