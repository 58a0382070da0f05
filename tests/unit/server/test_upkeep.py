"""``Upkeep``: jobs run at their interval on the server's one clock (a clock
the test moves), a failing job is counted and the others go on, a job off the
loop runs on a thread of its own and is never doubled."""

from __future__ import annotations

import threading

import pytest

from kvtier.server.upkeep import Upkeep
from tests.conftest import FakeClock


def test_jobs_run_at_their_intervals(clock: FakeClock) -> None:
    upkeep = Upkeep(clock)
    runs: list[tuple[str, float]] = []
    upkeep.every("often", 1.0, lambda: runs.append(("often", clock.now)))
    upkeep.every("seldom", 2.5, lambda: runs.append(("seldom", clock.now)))
    start = clock.now
    for _ in range(12):  # ticks every half second, for six seconds
        clock.advance(0.5)
        upkeep.run_due()
    assert [(name, t - start) for name, t in runs] == [
        ("often", 1.0),
        ("often", 2.0),
        ("seldom", 2.5),
        ("often", 3.0),
        ("often", 4.0),
        ("often", 5.0),
        ("seldom", 5.0),
        ("often", 6.0),
    ]
    assert upkeep.status() == {"runs.often": 6, "runs.seldom": 2}


def test_a_late_tick_runs_a_job_once_and_its_next_run_counts_from_then(clock: FakeClock) -> None:
    upkeep = Upkeep(clock)
    runs: list[float] = []
    upkeep.every("job", 1.0, lambda: runs.append(clock.now))
    start = clock.now
    clock.advance(3.7)  # the loop was busy for several intervals
    upkeep.run_due()
    clock.advance(0.9)
    upkeep.run_due()
    clock.advance(0.1)
    upkeep.run_due()
    assert [round(t - start, 6) for t in runs] == [3.7, 4.7]


def test_a_failing_job_is_counted_and_the_others_go_on(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    upkeep = Upkeep(clock)
    good: list[float] = []

    def broken() -> None:
        raise OSError("disk gone")

    upkeep.every("broken", 1.0, broken)
    upkeep.every("good", 1.0, lambda: good.append(clock.now))
    for _ in range(3):
        clock.advance(1.0)
        upkeep.run_due()  # never raises
    assert len(good) == 3
    assert upkeep.status() == {"errors.broken": 3, "runs.good": 3}
    logged = [r for r in caplog.records if "upkeep: broken" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # its traceback, once


def test_a_job_off_the_loop_runs_on_its_own_thread_and_is_never_doubled(
    clock: FakeClock,
) -> None:
    upkeep = Upkeep(clock)
    started, release = threading.Event(), threading.Event()
    ran_on: list[str] = []

    def slow() -> None:
        ran_on.append(threading.current_thread().name)
        started.set()
        assert release.wait(30), "the test never released the job"

    upkeep.every("slow", 1.0, slow, on_loop=False)
    clock.advance(1.0)
    upkeep.run_due()  # returns at once: the job runs elsewhere
    assert started.wait(30)
    clock.advance(1.0)
    upkeep.run_due()  # still running: this turn is skipped
    release.set()
    upkeep.close()
    assert ran_on == ["kvtier-slow"]
    assert upkeep.status() == {"overran.slow": 1, "runs.slow": 1}
    clock.advance(1.0)
    upkeep.run_due()  # closed: nothing starts
    assert ran_on == ["kvtier-slow"]


def test_a_failure_off_the_loop_is_counted(clock: FakeClock) -> None:
    upkeep = Upkeep(clock)

    def broken() -> None:
        raise ValueError("bad index")

    upkeep.every("broken", 1.0, broken, on_loop=False)
    clock.advance(1.0)
    upkeep.run_due()
    upkeep.close()  # waits for the run
    assert upkeep.status() == {"errors.broken": 1}


@pytest.mark.parametrize(
    ("name", "interval", "message"),
    [
        ("", 1.0, "name '' is empty or already taken"),
        ("taken", 1.0, "name 'taken' is empty or already taken"),
        ("zero", 0.0, "upkeep job 'zero': interval_s must be > 0, got 0.0"),
        ("nan", float("nan"), "upkeep job 'nan': interval_s must be > 0, got nan"),
    ],
)
def test_bad_jobs_are_refused_by_name(
    clock: FakeClock, name: str, interval: float, message: str
) -> None:
    upkeep = Upkeep(clock)
    upkeep.every("taken", 1.0, lambda: None)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        upkeep.every(name, interval, lambda: None)
