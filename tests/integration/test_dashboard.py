"""The dashboard in a real headless browser (Debian's chromium and
chromedriver, selenium), against a live ``kvtier serve`` with traffic: the
page asks for a token, then draws non-empty charts, shows the numbers
``/metrics`` reports, and logs no console error; a screenshot is taken
(``KVTIER_DASHBOARD_SCREENSHOT=path`` keeps it, for the README)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, tenants_toml, wait_for

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


@pytest.fixture
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1500",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Chromium's temporary files (its profile's lock socket) go there, not to /tmp;
    # a short path: a socket's path has at most 107 bytes.
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium"))}
    driver = webdriver.Chrome(service=Service(str(DRIVER), env=env), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def traffic(server: Server) -> None:
    """An engine that prefills prompts twice (the second time from L1; it
    reports its prefill rate to the ledger), stores and lookups of a client,
    misses, and a refused hello (an error by reason)."""
    from kvtier.engine.hf import KVTierModel
    from tests.hf_helpers import prompt, tiny_model

    engine = KVTierModel(tiny_model("llama"), server=server.rpc, auth_token="acme-token")
    try:
        for seed in range(3):
            for _ in range(2):
                engine.prefill(prompt(seed, 900))
    finally:
        engine.close()
    size = w.object_bytes(256)
    acme = CacheClient(w.client_config(server.rpc, auth_token="acme-token"))
    intruder = CacheClient(
        w.client_config(server.rpc, auth_token="acme-token", salt="ops", request_timeout_s=1.0)
    )
    try:
        for seed in range(6):
            hashes = w.chunk_hashes(256, 60 + seed, 4)
            acme.store(f"s{seed}", hashes, w.payloads(60 + seed, 4, size))
            found = acme.query(acme.lookup(f"r{seed}", hashes), timeout_s=10.0) or 0
            if found:
                acme.release(f"r{seed}", 0, found)
            acme.query(acme.lookup(f"m{seed}", w.chunk_hashes(256, 90 + seed, 2)), timeout_s=10)
            time.sleep(0.4)  # spread over several of the dashboard's samples
    finally:
        acme.close()
        intruder.close()


def metrics(server: Server) -> dict[str, float]:
    """Every sample, named as the page names it: ``name{label="value",...}``
    (labels sorted)."""
    text = server.http_get("/metrics", token="ops-token")[1].decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def types(server: Server) -> dict[str, str]:
    text = server.http_get("/metrics", token="ops-token")[1].decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


@pytest.mark.slow
def test_the_dashboard_shows_live_numbers_in_a_real_browser(
    kvtier_server: ServerFactory, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml())
    server = kvtier_server.start("--tenants-file", str(path))
    traffic(server)

    browser.get(server.http + "/")  # no token: the page says what is missing
    message = wait_for(lambda: browser.find_element(By.ID, "message").text, bool)
    assert "needs an admin token" in message
    assert server.http_get("/admin/dashboard", token="")[0] == 401
    browser.get("about:blank")
    refused = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]  # only 401s
    assert refused and all("/admin/dashboard" in e["message"] and "401" in e["message"]
                           for e in refused), refused  # fmt: skip

    browser.get(server.http + "/#token=ops-token")
    drawn = wait_for(
        lambda: browser.execute_script("return window.kvtierDrawn"),
        lambda d: bool(d) and d.get("hit-ratio", 0) > 2 and d.get("flows", 0) > 2,
        timeout_s=30,
    )
    assert drawn["l1"] > 2 and drawn["errors"] >= 1

    def totals() -> tuple[dict[str, float], dict[str, float]]:
        """The page's totals table, and what ``/metrics`` reports after it."""
        shown = browser.execute_script(  # in one go: the page redraws the table as it polls
            """return Object.fromEntries(Array.from(
                 document.querySelectorAll('#totals td[data-metric]'),
                 (cell) => [cell.dataset.metric, parseFloat(cell.dataset.value)]));"""
        )
        return {name: float(value) for name, value in shown.items()}, metrics(server)

    # The page polls every few seconds: wait for a poll after the server's
    # snapshot has every number of the traffic.
    shown, reported = wait_for(
        totals,
        lambda seen: bool(seen[0]) and all(seen[1].get(k) == v for k, v in seen[0].items()),
        timeout_s=60,
        every_s=0.5,
    )
    assert shown, "the totals table is empty"
    assert 'kvtier_server_hit_tokens_total{tier="L1"}' in shown
    assert types(server)["kvtier_server_hit_tokens"] == "counter"
    for name, value in shown.items():
        assert reported.get(name) == value, (name, value, reported.get(name))
    assert shown['kvtier_server_errors_total{reason="forbidden"}'] >= 1
    loaded = [v for k, v in shown.items() if k.startswith("kvtier_ledger_loaded_tokens_total")]
    assert loaded and max(loaded) > 0  # the engine reported what it loaded
    ledger = browser.find_element(By.ID, "ledger").text
    assert "acme /" in ledger and " s" in ledger  # seconds saved: the engine reported its rate
    assert "loaded tokens" in ledger
    assert "has no field" not in server.log  # every counter the server counted is typed

    painted = browser.execute_script(
        """return Array.from(document.querySelectorAll('canvas')).map((c) => {
             const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
             let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
             return [c.id, n]; });"""
    )
    for canvas, pixels in painted:
        assert pixels > 500, (canvas, pixels)  # every chart drew something
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
    shot = Path(os.environ.get("KVTIER_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    assert browser.save_screenshot(str(shot))
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
