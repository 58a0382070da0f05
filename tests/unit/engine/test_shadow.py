"""``ShadowCheck``: sampling, the relative error and its verdicts."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.engine.shadow import ShadowCheck, relative_error


@pytest.mark.parametrize(("fraction", "tolerance"), [(-0.1, 0.02), (1.5, 0.02), (0.5, 0.0)])
def test_out_of_range_settings_are_refused(fraction: float, tolerance: float) -> None:
    with pytest.raises(ValueError, match="shadow"):
        ShadowCheck(fraction, tolerance)


def test_sampling_follows_the_fraction() -> None:
    assert not any(ShadowCheck(0.0).sample() for _ in range(1000))
    assert all(ShadowCheck(1.0).sample() for _ in range(1000))
    quarter = ShadowCheck(0.25, seed=7)
    share = sum(quarter.sample() for _ in range(4000)) / 4000
    assert 0.2 < share < 0.3


def test_relative_error_is_per_slice() -> None:
    computed = torch.stack([torch.full((8,), 100.0), torch.full((8,), 0.01)])
    served = computed.clone()
    assert relative_error(served, computed) == 0.0
    served[1, 0] += 0.01  # small next to the other slice, but 100% of its own
    assert relative_error(served, computed) == pytest.approx(1.0)


def test_verdicts_are_counted_and_mismatches_logged(caplog: pytest.LogCaptureFixture) -> None:
    check = ShadowCheck(1.0, tolerance=0.02)
    kv = torch.randn(4, 2, 16, 8)
    assert check.compare(kv.clone(), kv, "same") == (0.0, False)
    close = check.compare(kv * (1 + 1e-3), kv, "rounded")
    assert 0 < close.error < 0.02 and not close.mismatched
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.shadow"):
        wrong = check.compare(torch.randn(4, 2, 16, 8), kv, "chunk 3 of a test")
    assert wrong.mismatched and "chunk 3 of a test" in caplog.text
    nan = kv.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert check.compare(nan, kv, "nan").mismatched
    check.unavailable()
    stats = check.stats()
    assert (stats.checked_chunks, stats.mismatched_chunks, stats.unavailable_chunks) == (4, 2, 1)
    assert stats.worst_error == float("inf")
    with pytest.raises(ValueError, match="shapes"):
        check.compare(kv[:1], kv, "short")
