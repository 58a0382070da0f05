"""A reaper: a tiny child process that cleans up after this process if it
dies without doing so itself (SIGKILL, a crash, an unhandled SIGTERM).

The reaper blocks reading its stdin, whose write end only this process
holds (pipes are close-on-exec): the read returns when this process closes
it or dies. ``release`` first writes one byte, which tells the reaper that
the clean-up was done here and it has nothing to do; an end without that
byte makes it act:

- ``unlink PATH``: remove a file (the L1 arena in /dev/shm);
- ``killpg PGID``: SIGTERM a process group (a server started in a session
  of its own), then SIGKILL what is left of it after ``GRACE_S``.

It runs ``python -S`` with nothing imported but ``os``, ``signal``, ``sys``
and ``time``, in a session of its own (a ^C to this process's group must not
end it first).
"""

from __future__ import annotations

import subprocess
import sys

GRACE_S = 30.0  # a process group SIGTERMed by a reaper is SIGKILLed after this

_SCRIPT = """
import os, signal, sys, time
if sys.stdin.buffer.read():
    sys.exit(0)
action, target = sys.argv[1], sys.argv[2]
if action == "unlink":
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass
else:
    group = int(target)
    try:
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + float(sys.argv[3])
        while time.monotonic() < deadline:
            time.sleep(0.2)
            os.killpg(group, 0)
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""

ACTIONS = ("unlink", "killpg")


def start_reaper(action: str, target: str) -> subprocess.Popen[bytes]:
    """A reaper that does ``action`` (``ACTIONS``) on ``target`` if this
    process ends without ``release``."""
    if action not in ACTIONS:
        raise ValueError(f"reaper action must be one of {ACTIONS}, got {action!r}")
    return subprocess.Popen(
        [sys.executable, "-S", "-c", _SCRIPT, action, target, str(GRACE_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def release(reaper: subprocess.Popen[bytes]) -> None:
    """The clean-up was done here: let the reaper exit without acting."""
    assert reaper.stdin is not None
    try:
        reaper.stdin.write(b"x")
        reaper.stdin.close()
    except BrokenPipeError:  # it is gone already
        pass
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


__all__ = ["ACTIONS", "GRACE_S", "release", "start_reaper"]
