"""Quality-gate reports (``QUALITY_REPORT``): counted per tenant, namespace
and lossy path, shown in the status and on /metrics with those labels, an
engine's turning a path off logged once, and reports out of range refused."""

from __future__ import annotations

import logging

import pytest

from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.server.limits import ServerLimits
from kvtier.server.reports import LOSSY_PATHS
from kvtier.storage import StorageManager
from tests.conftest import FakeClock
from tests.unit.server.test_core import LAYOUT, call, hello
from tests.unit.server.test_status import scrape


@pytest.fixture
def server(storage: StorageManager, clock: FakeClock) -> CacheServer:
    limits = ServerLimits(session_ttl_s=100, client_ttl_s=1000)
    return CacheServer(storage, chunk_size=16, limits=limits, clock=clock)


def test_samples_are_counted_by_path_and_shown_with_labels(
    server: CacheServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.server.quality")
    assert isinstance(hello(server, b"A"), p.Welcome)
    for agreed, kl in ((True, 0.1), (False, 0.7), (True, 0.2)):
        assert call(server, b"A", p.QualityReport("blend", agreed, kl)) == p.Ack()
    for _ in range(2):  # the engine says it turned the path off: logged once
        assert call(server, b"A", p.QualityReport("codec:int8", False, 2.0, off=True)) == p.Ack()

    rows = {row.path: row for row in server.status().quality}
    blend, codec = rows["blend"], rows["codec:int8"]
    assert (blend.namespace, blend.samples, blend.agreed, blend.off) == ("org--m@", 3, 2, False)
    assert blend.kl_sum == pytest.approx(1.0)
    assert (codec.samples, codec.agreed, codec.off) == (2, 0, True)
    turned_off = [r for r in caplog.records if "turned" in r.getMessage()]
    assert len(turned_off) == 1 and "codec:int8" in turned_off[0].getMessage()

    metrics = scrape(server.status())
    labels = ("namespace=org--m@", "path=blend", "tenant=default")
    assert metrics["kvtier_quality_samples"] == ("counter", {
        labels: 3.0, ("namespace=org--m@", "path=codec:int8", "tenant=default"): 2.0,
    })  # fmt: skip
    assert metrics["kvtier_quality_off"][0] == "gauge"
    assert metrics["kvtier_quality_off"][1][labels] == 0.0


@pytest.mark.parametrize(
    ("report", "says"),
    [
        (p.QualityReport("codec", True, 0.1), "path must be one of ['blend', 'codec:int8'"),
        (p.QualityReport("codec:", True, 0.1), "path must be"),
        (p.QualityReport("codec:zstd", True, 0.1), "path must be"),  # lossless: nothing to gate
        (p.QualityReport("blend\n", True, 0.1), "path must be"),
        (p.QualityReport("codec:" + "x" * 64, True, 0.1), "path must be"),
        (p.QualityReport("blend", True, -0.1), "kl must be in [0, 1000.0]"),
        (p.QualityReport("blend", True, float("nan")), "kl must be"),
        (p.QualityReport("blend", True, 1e9), "kl must be"),
    ],
)
def test_a_report_out_of_range_is_refused_naming_the_field(
    server: CacheServer, report: p.QualityReport, says: str
) -> None:
    assert isinstance(hello(server, b"A"), p.Welcome)
    reply = call(server, b"A", report)
    assert isinstance(reply, p.Error) and reply.code == "bad_request"
    assert says in reply.message
    assert server.status().quality == []


def test_one_client_cannot_grow_the_board_past_the_lossy_paths(server: CacheServer) -> None:
    """Ten thousand reports under made-up paths: every one refused, and the
    board (and /metrics' path labels) holds at most one row per lossy path."""
    assert isinstance(hello(server, b"A"), p.Welcome)
    for n in range(10_000):
        reply = call(server, b"A", p.QualityReport(f"codec:x{n}", True, 0.0))
        assert isinstance(reply, p.Error) and reply.code == "bad_request"
    for path in LOSSY_PATHS:
        assert call(server, b"A", p.QualityReport(path, True, 0.0)) == p.Ack()
    assert sorted(row.path for row in server.status().quality) == sorted(LOSSY_PATHS)


def test_one_client_under_ever_new_model_names_cannot_grow_the_board(
    storage: StorageManager, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The finding: a row's key is (tenant, namespace, path), and the namespace
    is whatever model name the client sends in HELLO. One client registering
    400 times under new names made 401 rows, /metrics' quality lines went
    from 4 to 1,604 and the log took a warning each. Now the tenant's rows
    stay within limits.max_namespace_rows, the samples are all counted (the
    least recent under "(other)"), and the log is bounded too."""
    caplog.set_level(logging.WARNING, logger="kvtier.server.quality")
    limits = ServerLimits(session_ttl_s=100, client_ttl_s=1000, max_namespace_rows=16)
    server = CacheServer(storage, chunk_size=16, limits=limits, clock=clock)
    for n in range(400):
        message = p.Hello(p.PROTOCOL_VERSION, "spam", f"org/m{n}", [LAYOUT], 1, 16)
        assert isinstance(call(server, b"A", message), p.Welcome)
        assert call(server, b"A", p.QualityReport("blend", False, 1.0, off=True)) == p.Ack()
    rows = server.status().quality
    assert len(rows) <= 16
    assert sum(row.samples for row in rows) == 400
    assert any(row.namespace == "(other)" and row.off for row in rows)
    metrics = scrape(server.status())
    samples = [n for name, (_, by) in metrics.items() if "quality" in name for n in by]
    assert 0 < len(samples) <= 16 * 4  # a handful of families, one sample per row each
    assert len(caplog.records) <= 16 + 1
