"""The cost estimator: a fixed part and a part per token, recovered from
noisy samples with outliers, whatever the mix of prompt sizes."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kvtier.costfit import CostFit, SingleRate

FIXED, PER_TOKEN, STEP = 0.010, 1e-4, 8192  # 10 ms a step, 10 k tokens/s


def true_s(tokens: int) -> float:
    return FIXED * math.ceil(tokens / STEP) + PER_TOKEN * tokens


def samples(seed: int, n: int, short_share: float) -> list[tuple[int, float]]:
    """``n`` prefills, ``short_share`` of them under 1 K tokens, the rest up to
    32 K; times off by up to 5 %, and 5 % of them stalled (3-10x)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = rng.randint(16, 1000) if rng.random() < short_share else rng.randint(1000, 32000)
        seconds = true_s(tokens) * rng.uniform(0.95, 1.05)
        if rng.random() < 0.05:
            seconds *= rng.uniform(3, 10)
        out.append((tokens, seconds))
    return out


@pytest.mark.parametrize("short_share", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("seed", range(5))
def test_both_parts_are_recovered_within_ten_percent(seed: int, short_share: float) -> None:
    fit = CostFit(0.0, 1e-3, window=64, step_tokens=STEP)  # a prior 10x off
    for tokens, seconds in samples(seed, 300, short_share):
        fit.add(tokens, seconds)
    assert fit.fixed_s == pytest.approx(FIXED, rel=0.1)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=0.1)


@pytest.mark.parametrize("seed", range(5))
def test_with_few_short_prompts_the_rate_is_still_right(seed: int) -> None:
    """A tenth of short prompts: a window holds a handful, and the 10 ms
    under 5 % noise on seconds-long prefills is known only to about 30 %;
    the rate, which is what prices long prompts, stays within 10 %."""
    fit = CostFit(0.0, 1e-3, window=64, step_tokens=STEP)
    for tokens, seconds in samples(seed, 300, short_share=0.1):
        fit.add(tokens, seconds)
    assert fit.per_token_s == pytest.approx(PER_TOKEN, rel=0.1)
    assert fit.fixed_s == pytest.approx(FIXED, rel=0.3)


def test_short_prompts_do_not_inflate_the_rate_as_a_single_rate_does() -> None:
    fit = CostFit(0.0, 1e-3, step_tokens=STEP)
    single = SingleRate(1e-3, ewma=0.2)
    fitted, rates = [], []
    for tokens, seconds in samples(7, 400, short_share=0.7):
        fit.add(tokens, seconds)
        single.add(tokens, seconds)
        fitted.append(fit.per_token_s)
        rates.append(single.per_token_s)
    assert statistics.mean(fitted[200:]) == pytest.approx(PER_TOKEN, rel=0.1)
    assert statistics.mean(rates[200:]) > 1.3 * PER_TOKEN  # the fixed step read as a rate


def test_the_order_inside_the_window_does_not_matter() -> None:
    window = samples(3, 64, short_share=0.3)
    fits = []
    for order in range(3):
        shuffled = window[:]
        random.Random(order).shuffle(shuffled)
        fit = CostFit(0.0, 1e-3, window=64, step_tokens=STEP)
        for tokens, seconds in samples(99, 50, short_share=0.5) + shuffled:  # older: forgotten
            fit.add(tokens, seconds)
        fits.append((fit.fixed_s, fit.per_token_s))
    for fixed, per_token in fits[1:]:
        assert fixed == pytest.approx(fits[0][0], rel=1e-9)
        assert per_token == pytest.approx(fits[0][1], rel=1e-9)


def test_a_change_of_engine_is_followed_within_a_window() -> None:
    fit = CostFit(0.0, 1e-3, window=32, step_tokens=STEP)
    for tokens, seconds in samples(1, 100, 0.3):
        fit.add(tokens, seconds)
    for tokens, seconds in samples(2, 32, 0.3):
        fit.add(tokens, 2 * seconds)  # the engine is now twice as slow
    assert fit.per_token_s == pytest.approx(2 * PER_TOKEN, rel=0.1)
    assert fit.fixed_s == pytest.approx(2 * FIXED, rel=0.15)


def test_one_size_only_keeps_the_prior_fixed_part_and_fits_the_rate() -> None:
    fit = CostFit(0.005, 1e-3, step_tokens=STEP)
    for _ in range(10):
        fit.add(2000, 0.005 + 2000 * 2e-4)
    assert fit.fixed_s == 0.005
    assert fit.per_token_s == pytest.approx(2e-4)


def test_no_part_goes_below_zero_and_meaningless_samples_are_ignored() -> None:
    fit = CostFit(0.0, 1e-3)
    for tokens in (100, 1000, 10000):
        fit.add(tokens, 1e-5 * tokens - 1e-4 if tokens > 100 else 5e-4)  # fits a negative fixed
    assert fit.fixed_s >= 0 and fit.per_token_s >= 0
    before = fit.status()
    for tokens, seconds in ((0, 1.0), (100, 0.0), (100, -1.0), (100, math.nan), (100, math.inf)):
        fit.add(tokens, seconds)
    assert fit.status() == before


def test_a_prompt_longer_than_a_step_pays_each_step() -> None:
    fit = CostFit(0.01, 1e-4, step_tokens=1000)
    assert fit.steps(1) == fit.steps(1000) == 1 and fit.steps(1001) == 2
    assert fit.seconds(2500) == pytest.approx(3 * 0.01 + 0.25)
    assert CostFit(0.01, 1e-4).steps(10**6) == 1  # no step size: one step


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        CostFit(-1.0, 1e-4)
    with pytest.raises(ValueError, match="window"):
        CostFit(0.0, 1e-4, window=1)
