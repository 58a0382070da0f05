"""The savings ledger's arithmetic (``SavingsLedger``): saved seconds are the
tokens engines report loading, each report's at the rate it carries; what
lookups served is counted apart and saves nothing. The rates are powers of
two, so every product and sum below is exact."""

from __future__ import annotations

from kvtier.keys import NamespaceLabel
from kvtier.protocol.messages import prefill_rate
from kvtier.tenancy.ledger import SavingsLedger

NS = NamespaceLabel("llama", "acme")


def test_each_report_is_credited_its_loaded_tokens_at_its_own_rate() -> None:
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 1024)  # lookups found 1,024 tokens
    ledger.reported("acme", NS, 0.5, 1.0, 100)  # an engine loaded 100 of them
    ledger.reported("acme", NS, 0.25, 2.0, 40)  # another, twice as fast, loaded 40
    (row,) = ledger.report()["namespaces"]
    assert row == {
        "tenant": "acme",
        "namespace": "llama@acme",
        "served_tokens": {"L1": 1024},
        "loaded_tokens": 140,
        "prefill_s_per_token": 0.8 * 0.5 + 0.2 * 0.25,  # the mean that lookups are priced at
        "rate_reported": True,
        "saved_s": 100 * 0.5 + 40 * 0.25,  # 60 s: each report at its own rate
        "load_s": 3.0,
        "net_s": 57.0,
    }
    assert ledger.report()["tenants"] == {
        "acme": {
            "served_tokens": 1024,
            "loaded_tokens": 140,
            "saved_s": 60.0,
            "load_s": 3.0,
            "net_s": 57.0,
        }
    }


def test_tokens_served_but_not_loaded_save_nothing() -> None:
    """vLLM held the prefix itself: its lookup found it, its reports loaded none."""
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 512)
    ledger.reported("acme", NS, 0.5, 0.0, 0)
    (row,) = ledger.report()["namespaces"]
    assert row["saved_s"] == 0.0 and row["net_s"] == 0.0
    assert row["served_tokens"] == {"L1": 512} and row["loaded_tokens"] == 0


def test_a_report_without_a_rate_is_priced_at_the_namespaces_then_waits() -> None:
    ledger = SavingsLedger()
    ledger.reported("acme", NS, 0.0, 0.5, 64)  # no rate anywhere yet: unknown, not invented
    (row,) = ledger.report()["namespaces"]
    assert row["loaded_tokens"] == 64 and row["prefill_s_per_token"] is None
    assert row["saved_s"] is None and row["net_s"] is None
    assert row["load_s"] == 0.5

    ledger.reported("acme", NS, 0.25, 0.0, 0)  # the first rate prices the waiting tokens
    assert ledger.report()["namespaces"][0]["saved_s"] == 64 * 0.25
    ledger.reported("acme", NS, 0.0, 0.5, 8)  # a report without a rate: the namespace's
    (row,) = ledger.report()["namespaces"]
    assert row["saved_s"] == 64 * 0.25 + 8 * 0.25 and row["net_s"] == 18.0 - 1.0


def test_without_reported_rates_the_default_prices_the_loads() -> None:
    ledger = SavingsLedger(default_prefill_s_per_token=0.125)
    ledger.reported("acme", NS, 0.0, 0.25, 80)
    (row,) = ledger.report()["namespaces"]
    assert row["prefill_s_per_token"] == 0.125 and not row["rate_reported"]
    assert row["saved_s"] == 10.0 and row["net_s"] == 9.75
    assert ledger.measured_rate("acme", NS) is None


def test_rows_give_served_by_tier_and_loaded_saved_and_net_by_namespace() -> None:
    ledger = SavingsLedger()
    ledger.served("acme", NS, "L1", 256)
    ledger.served("acme", NS, "fs", 512)
    ledger.reported("acme", NS, 0.5, 4.0, 256)
    ledger.served("globex", NS, "L1", 256)  # no report: nothing loaded, nothing saved
    rows = {row["tenant"]: row for row in ledger.report()["namespaces"]}
    numbers = ("served_tokens", "loaded_tokens", "load_s", "saved_s", "net_s")
    assert {t: tuple(row[n] for n in numbers) for t, row in rows.items()} == {
        "acme": ({"L1": 256, "fs": 512}, 256, 4.0, 128.0, 124.0),
        "globex": ({"L1": 256}, 0, 0.0, 0.0, 0.0),
    }


def test_a_forward_too_short_samples_no_rate() -> None:
    assert prefill_rate(2.0, 32) == 2.0 / 32
    assert prefill_rate(2.0, 31) == 0.0


def test_namespaces_past_the_row_limit_are_summed_under_other() -> None:
    """The ledger's rows are keyed by namespaces clients name: one client
    under 400 model names keeps at most the limit of rows, the rest summed
    under "(other)", every token and second still counted."""
    ledger = SavingsLedger(rows_per_tenant=8)
    for n in range(400):
        namespace = NamespaceLabel(f"m{n}", "acme")
        ledger.served("acme", namespace, "L1", 16)
        ledger.reported("acme", namespace, 0.5, 0.25, 4)
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
