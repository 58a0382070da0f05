"""``PrefillQueue``: the projected drain time follows dispatches, first
tokens (early or late) and requests that leave before one."""

from __future__ import annotations

import pytest

from kvtier.router.queue import PrefillQueue


def test_a_request_starts_when_the_work_ahead_drains() -> None:
    queue = PrefillQueue()
    assert queue.dispatch(10.0, 2.0, 100) == 12.0
    assert queue.dispatch(11.0, 3.0, 50) == 15.0  # behind the first
    assert queue.wait_s(11.0) == 4.0
    assert (queue.tokens, queue.requests) == (150, 2)
    assert queue.dispatch(20.0, 1.0, 10) == 21.0  # an idle node: now


def test_a_half_done_prefill_counts_only_what_is_left() -> None:
    """The old estimate summed whole plans: 2 + 3 s seen at t = 11. The
    drain time knows one second of the first is done."""
    queue = PrefillQueue()
    queue.dispatch(10.0, 2.0, 100)
    queue.dispatch(10.0, 3.0, 100)
    assert queue.wait_s(11.0) == 4.0


@pytest.mark.parametrize(("at", "drain"), [(11.0, 14.0), (13.5, 16.5)])
def test_a_first_token_moves_the_work_behind_it(at: float, drain: float) -> None:
    queue = PrefillQueue()
    first = queue.dispatch(10.0, 2.0, 100)
    queue.dispatch(10.0, 3.0, 100)
    queue.first_token(at, first, 100)  # a second early, or 1.5 s late
    assert queue.drain_at == drain
    assert (queue.tokens, queue.requests) == (100, 1)


def test_the_last_first_token_empties_the_queue() -> None:
    queue = PrefillQueue()
    planned = queue.dispatch(10.0, 2.0, 100)
    queue.first_token(10.5, planned, 100)
    assert queue.wait_s(10.5) == 0.0 and (queue.tokens, queue.requests) == (0, 0)


def test_a_request_that_leaves_takes_its_remaining_work() -> None:
    queue = PrefillQueue()
    queue.dispatch(10.0, 2.0, 100)
    second = queue.dispatch(10.0, 3.0, 50)
    queue.cancel(11.0, second, 3.0, 50)  # it had not started: all 3 s go
    assert queue.drain_at == 12.0 and queue.tokens == 100
