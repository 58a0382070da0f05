"""The purger holds a worker thread only while a job runs: none at rest, one
per burst of jobs (a new one for a job started after the last ended), and one
at start-up for a job resumed from the state file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import KeySelector
from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager
from kvtier.tenancy.purge import PurgeConfig, Purger
from tests.conftest import make_key
from tests.integration.harness import wait_for

FAST = PurgeConfig(pause_s=0.0, settle_s=0.0)


def workers() -> int:
    return sum(t.name == "kvtier-purge" for t in threading.enumerate())


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    config = StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False))
    with StorageManager(config) as storage:
        yield storage


def finished(purger: Purger, job_id: str) -> str:
    job = wait_for(lambda: purger.job(job_id), lambda j: j is not None and j["state"] != "running")
    assert job is not None
    return str(job["state"])


def test_a_worker_runs_only_while_a_job_does(storage: StorageManager) -> None:
    purger = Purger(storage, None, FAST)
    try:
        assert workers() == 0
        for round_ in range(2):  # the second job finds no worker: it starts one
            keys = [make_key(10 * round_ + i, salt="acme") for i in range(3)]
            storage.store(keys, [np.zeros(4096, np.uint8)] * 3)
            job = purger.start(KeySelector(salt="acme"))
            assert finished(purger, job.id) == "done"
            assert not any(storage.in_l1(k) for k in keys)
            assert wait_for(workers, lambda n: n == 0) == 0
    finally:
        purger.close()


def test_a_job_resumed_from_the_state_file_starts_a_worker(
    storage: StorageManager, tmp_path: Path
) -> None:
    state = tmp_path / "purges.json"  # as a server stopped mid-purge left it
    job = {"id": "j1", "model": None, "salt": "acme", "state": "running", "tiers": {}}
    state.write_text(json.dumps([job]))
    storage.store([make_key(1, salt="acme")], [np.zeros(4096, np.uint8)])
    purger = Purger(storage, state, FAST)
    try:
        assert finished(purger, "j1") == "done"
        assert not storage.in_l1(make_key(1, salt="acme"))
        assert wait_for(workers, lambda n: n == 0) == 0
    finally:
        purger.close()
