"""Times the machine itself stopped running anything on a core.

A latency benchmark on a small VM measures the VM too: on this 2-core one a
process pinned to a core, asleep for a millisecond, sometimes wakes half a
second to a second late, whatever it runs beside. ``StallWatch`` keeps one
such sleeper per core (a process of its own, so no GIL or benchmark work
delays it) and records every wake-up later than ``threshold_s``; a timed
sample that overlaps one is reported apart, so a benchmark can tell its own
outliers from the machine's. Each sleeper costs about a thousand wake-ups a
second.

    python benchmarks/stalls.py --core N --out FILE   (what each sleeper runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

NAP_S = 0.001


@dataclass(frozen=True, slots=True)
class Stall:
    core: int
    start: float  # wall clock (time.time), when the sleeper went to sleep
    seconds: float  # how long it slept instead of NAP_S

    def overlaps(self, start: float, end: float) -> bool:
        """Whether it overlaps [start, end] (wall-clock seconds)."""
        return self.start < end and self.start + self.seconds > start


class StallWatch:
    """``with StallWatch() as watch:`` around a benchmark, then ``watch.stalls()``
    (each ``Stall.overlaps(start, end)`` a timed sample or not)."""

    def __init__(self, threshold_s: float = 0.05, cores: set[int] | None = None) -> None:
        self.threshold_s = threshold_s
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-stalls-"))
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> StallWatch:
        for core in self.cores:
            command = [sys.executable, __file__, "--core", str(core)]
            command += ["--out", str(self._path(core)), "--threshold-s", str(self.threshold_s)]
            self._procs.append(subprocess.Popen(command))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            proc.wait(timeout=10)

    def stalls(self) -> list[Stall]:
        found = []
        for core in self.cores:
            path = self._path(core)
            if path.exists():
                for line in path.read_text().splitlines():
                    start, seconds = line.split()
                    found.append(Stall(core, float(start), float(seconds)))
        return sorted(found, key=lambda stall: stall.start)

    def _path(self, core: int) -> Path:
        return self._dir / f"core-{core}.txt"


def sleep_on(core: int, out: Path, threshold_s: float) -> None:
    os.sched_setaffinity(0, {core})
    with out.open("w") as log:
        last = time.time()
        while True:
            time.sleep(NAP_S)
            now = time.time()
            if now - last > threshold_s:
                log.write(f"{last:.6f} {now - last:.6f}\n")
                log.flush()
            last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threshold-s", type=float, default=0.05)
    args = parser.parse_args()
    sleep_on(args.core, args.out, args.threshold_s)  # until terminated


if __name__ == "__main__":
    main()
