"""``Background``: a part of a robustness run that works on a thread of its
own (a tenant's traffic, the flood of names, the router's traffic, the
memory monitor) until its ``stop`` is set."""

from __future__ import annotations

import threading


class Background:
    """Subclasses do their work in ``_run``, watching ``stop``."""

    def __init__(self, name: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop the work and wait for it (a second close does nothing more)."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        raise NotImplementedError
