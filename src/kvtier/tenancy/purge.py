"""``Purger``: remove a namespace's (or a tenant's) objects from every tier,
in batches, on a worker thread that runs while any job does, with progress.

A job names a ``KeySelector`` and goes, one batch at a time (the server
keeps serving in between)::

    L1 ──► each L2 adapter in order ──► settle (wait, then every tier once more) ──► done

- **L1**: resident objects the selector matches are purged a batch at a
  time (``L1Manager.purge``). One a reader holds (a read lock, an I/O fence)
  leaves the resident table at once, so no later lookup finds it, and its
  memory is freed when the last reader lets go: a read in flight finishes,
  a later one misses, memory is never freed under a reader. The pass ends
  once no purged object is still being written to an L2 (a write-back in
  flight), so the L2 passes after it find what that write-back wrote.
- **L2**: ``L2Adapter.purge`` (directory index, Redis SCAN + UNLINK, S3
  listing + batch delete, Mooncake remove by regex), cursor by cursor; a
  backend failure is counted and retried after a pause, up to ``max_errors``.
- **Settle**: objects a lookup was loading, a write-back was writing or a
  Mooncake read lease kept while the job ran are removed by one more pass
  over every tier after ``settle_s``. Its L1 pass first waits for the
  namespace's loads still in flight to land (L2 holds nothing of it now, so
  no new one starts).

A wait in L1 that lasts past ``hold_wait_s`` fails the job (purge again):
a job is done only once every object it purged is gone or unreachable.

While a job runs the server refuses stores into the namespace (``purging``),
so nothing new appears behind it. Jobs are kept in ``state_file`` (JSON, next
to the fs L2) after every step: a server restarted mid-purge resumes each
unfinished job from the start (every step is idempotent). Only the last
``KEPT_FINISHED_JOBS`` finished jobs are kept, so that many purges cost
neither memory nor a state file rewritten ever longer.

The worker starts with the first running job (``start``, or a job resumed
from the state file) and ends once no job runs: a server that purges
nothing holds no thread for it. Thread safety: one lock guards the job
table and the worker's handle (a job started as the worker finds nothing
left to do either is seen by it or starts a new one); the storage has its
own lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.keys import KeySelector
from kvtier.l1 import L1Result
from kvtier.storage import StorageManager

log = logging.getLogger(__name__)
L1_TIER = "L1"
KEPT_FINISHED_JOBS = 100


@dataclass(frozen=True, slots=True)
class PurgeConfig:
    """``[purge]``: how purges pace themselves."""

    batch_objects: int = 1024  # objects deleted per step
    pause_s: float = 0.002  # between steps: the server keeps serving
    settle_s: float = 1.0  # before the last pass over every tier
    max_errors: int = 20  # backend failures per tier before the job fails
    hold_wait_s: float = 60.0  # how long L1 waits for the namespace's loads and write-backs

    def __post_init__(self) -> None:
        if self.batch_objects < 1 or self.max_errors < 1:
            raise ValueError("purge.batch_objects and purge.max_errors must be >= 1")
        if min(self.pause_s, self.settle_s, self.hold_wait_s) < 0:
            raise ValueError("purge.pause_s, settle_s and hold_wait_s must be >= 0")


@dataclass(slots=True)
class TierProgress:
    deleted: int = 0
    passes: int = 0
    errors: int = 0
    held: int = 0  # L1: purged objects a reader held (unreachable, freed as it lets go)
    done: bool = False


@dataclass(slots=True)
class PurgeJob:
    id: str
    model: str | None
    salt: str | None
    state: str = "running"  # running, done, failed
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str = ""
    tiers: dict[str, TierProgress] = field(default_factory=dict)

    @property
    def selector(self) -> KeySelector:
        return KeySelector(self.model, self.salt)

    @property
    def deleted(self) -> int:
        return sum(t.deleted for t in self.tiers.values())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["namespace"] = self.selector.name()
        out["deleted"] = self.deleted
        return out


class Purger:
    """See the module docstring."""

    def __init__(
        self,
        storage: StorageManager,
        state_file: Path | None = None,
        config: PurgeConfig | None = None,
    ) -> None:
        self.storage = storage
        self.state_file = state_file
        config = config or PurgeConfig()
        self.batch = config.batch_objects
        self.pause_s = config.pause_s
        self.settle_s = config.settle_s
        self.max_errors = config.max_errors
        self.hold_wait_s = config.hold_wait_s
        self._lock = threading.Lock()
        self._jobs: dict[str, PurgeJob] = {}
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None  # alive while a job runs
        with self._lock:
            for job in self._load():
                self._jobs[job.id] = job
            self._start_worker_locked()

    # ---------------------------------------------------------- requests

    def start(self, selector: KeySelector) -> PurgeJob:
        """A new job for ``selector``, or the one already running for it."""
        with self._lock:
            for job in self._jobs.values():
                if job.state == "running" and job.selector == selector:
                    return job
            job = PurgeJob(uuid.uuid4().hex[:12], selector.model, selector.salt)
            self._jobs[job.id] = job
            self._save_locked()
            self._start_worker_locked()
        log.info("purge %s: %s started", job.id, selector.name())
        return job

    def purging(self, model: str, salt: str) -> bool:
        """Whether a running job covers this namespace (stores are refused)."""
        with self._lock:
            return any(
                j.state == "running"
                and (j.model is None or j.model == model)
                and (j.salt is None or j.salt == salt)
                for j in self._jobs.values()
            )

    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.to_json() for j in self._jobs.values()]

    def job(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return job.to_json() if job is not None else None

    def close(self) -> None:
        """Stop the worker between two steps (unfinished jobs resume at the next start)."""
        with self._lock:
            self._stop.set()
            worker = self._worker
        if worker is not None:
            worker.join(timeout=10)

    # ------------------------------------------------------------ worker

    def _start_worker_locked(self) -> None:
        """Start the worker if a job runs and no worker does (caller holds the lock)."""
        if self._worker is not None or self._stop.is_set():
            return
        if any(j.state == "running" for j in self._jobs.values()):
            self._worker = threading.Thread(target=self._run, name="kvtier-purge", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                running = [j for j in self._jobs.values() if j.state == "running"]
                if not running:
                    self._worker = None  # a later start() starts another
                    return
            for job in running:
                try:
                    self._purge(job)
                except Exception as exc:  # a purge must never take the server down
                    log.exception("purge %s failed", job.id)
                    self._finish(job, "failed", str(exc))

    def _purge(self, job: PurgeJob) -> None:
        tiers = self.storage.tiers()  # L1_TIER first
        for name in tiers:
            job.tiers.setdefault(name, TierProgress())
        for settling in (False, True):
            if settling and self._sleep(self.settle_s):
                return
            for name in tiers:
                progress = job.tiers[name]
                if settling:
                    progress.done = False
                if name == L1_TIER:
                    ok = self._l1(job, progress, settling)
                else:
                    ok = self._l2(job, name, progress)
                if not ok:
                    return
        self._finish(job, "done")

    def _l1(self, job: PurgeJob, progress: TierProgress, settling: bool) -> bool:
        """Purge what L1 holds of the namespace (held objects become
        unreachable at once), then wait for write-backs of them to end. In
        the last pass L2 holds nothing of it, so no new load can start: the
        loads in flight are waited for first, and purged here too."""
        selector, storage = job.selector, self.storage
        if settling and not self._wait_l1(
            job, "being loaded or stored", lambda: storage.staging_count(selector)
        ):
            return False
        matched = storage.resident_keys(selector)
        for start in range(0, len(matched), self.batch):
            results = storage.purge_l1(matched[start : start + self.batch])
            progress.deleted += sum(r in (L1Result.SUCCESS, L1Result.LOCKED) for r in results)
            progress.held += sum(r is L1Result.LOCKED for r in results)
            if self._step(job):
                return False
        if not self._wait_l1(
            job, "being written to an L2", lambda: storage.purged_in_io_count(selector)
        ):
            return False
        progress.passes += 1
        progress.done = True
        self._save()
        return True

    def _wait_l1(self, job: PurgeJob, what: str, count: Callable[[], int]) -> bool:
        """Wait until ``count()`` (L1 objects of the job's namespace that are
        ``what``) is 0; False when stopping, or failed after ``hold_wait_s``."""
        deadline = time.monotonic() + self.hold_wait_s
        while left := count():
            if time.monotonic() > deadline:
                error = f"L1: {left} objects still {what} after {self.hold_wait_s} s"
                self._finish(job, "failed", f"{error}; purge again")
                return False
            if self._sleep(0.05):
                return False
        return True

    def _l2(self, job: PurgeJob, name: str, progress: TierProgress) -> bool:
        cursor: str | None = None
        while not progress.done:
            try:
                step = self.storage.purge_l2(name, job.selector, cursor, self.batch)
            except Exception as exc:
                progress.errors += 1
                log.warning("purge %s: %s failed (%s); retrying", job.id, name, exc)
                if progress.errors >= self.max_errors:
                    self._finish(job, "failed", f"{name}: {exc}")
                    return False
                if self._sleep(min(0.1 * progress.errors, 2.0)):
                    return False
                continue
            progress.deleted += step.deleted
            cursor = step.cursor
            progress.done = cursor is None
            if progress.done:
                progress.passes += 1
            if self._step(job):
                return False
        return True

    def _step(self, job: PurgeJob) -> bool:
        """Between batches: save, yield to the server; True when stopping."""
        self._save()
        return self._sleep(self.pause_s)

    def _sleep(self, seconds: float) -> bool:
        return self._stop.wait(seconds)

    def _finish(self, job: PurgeJob, state: str, error: str = "") -> None:
        with self._lock:
            job.state, job.error, job.finished = state, error, time.time()
            finished = [j for j in self._jobs.values() if j.state != "running"]
            for old in finished[:-KEPT_FINISHED_JOBS]:  # the table is in start order
                del self._jobs[old.id]
            self._save_locked()
        log.info("purge %s: %s, %d objects deleted", job.id, state, job.deleted)

    # -------------------------------------------------------- persistence

    def _save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        if self.state_file is None:
            return
        data = [asdict(j) for j in self._jobs.values()]
        temp = self.state_file.with_name(self.state_file.name + f".tmp-{os.getpid()}")
        try:
            temp.write_text(json.dumps(data))
            temp.replace(self.state_file)
        except OSError as exc:
            log.warning("purge: could not save %s: %s", self.state_file, exc)

    def _load(self) -> list[PurgeJob]:
        """Jobs from the state file; an unfinished one starts again from the
        beginning (its steps are idempotent)."""
        if self.state_file is None or not self.state_file.exists():
            return []
        try:
            data = json.loads(self.state_file.read_text())
            jobs = []
            for item in data:
                tiers = {k: TierProgress(**v) for k, v in item.pop("tiers", {}).items()}
                job = PurgeJob(**item, tiers=tiers)
                if job.state == "running":
                    job.tiers = {}
                    log.info("purge %s: %s resumes", job.id, job.selector.name())
                jobs.append(job)
            return jobs
        except (OSError, ValueError, TypeError) as exc:
            log.warning("purge: could not read %s (%s); no jobs resumed", self.state_file, exc)
            return []


__all__ = ["L1_TIER", "PurgeConfig", "PurgeJob", "Purger", "TierProgress"]
