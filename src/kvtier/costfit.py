"""``CostFit``: a time that has a fixed part and a part that grows with tokens,
learned from samples.

An engine's prefill of ``n`` tokens takes about ``fixed x steps(n) +
per_token x n``: each engine step (vLLM's scheduler step, at most
``step_tokens`` tokens of a prompt) costs its launch, sampling and
bookkeeping whatever it computes, and every token its share of the
compute. A load from a tier takes a set-up (a round trip) plus a time per
token. Dividing a sample's whole time by its tokens folds the fixed part
into the rate: a 200-token prefill on an engine with 10 ms steps at
0.1 ms a token reads as 0.15 ms a token, 1.5 times the truth, and an
estimator fed many short prompts learns a rate far above what a long
prompt costs.

The fit keeps the last ``window`` samples (tokens, seconds) and solves, in
closed form, the least squares of the relative error (a short prompt's
10 ms matters as much as a long one's seconds, and it is the short ones
that say what is fixed)::

    seconds ~= fixed x steps(tokens) + per_token x tokens

It then drops the samples whose relative error is more than ``OUTLIER`` x
the median one and more than ``NOISE`` (a stalled engine, a request that
shared its step) and solves again. Only the window counts, so the order of samples inside it
does not matter. Until the window has two samples whose token counts
differ by a fifth, the fixed part stays the prior (``fixed_s``) and only
the rate is fitted; with no sample at all, both are the prior. Neither
term goes below zero: a fit that would make one negative sets it to zero
and fits the other alone.

``ScaledCost`` is another cost times a factor: a node that has not yet
taught its own fit is priced as the configured cost times how much slower
than that it has measured (``router/cost.py``).

``SingleRate`` is the estimator it replaced, kept to measure the
difference (``cost.estimator = "single_rate"``): each sample's seconds over
its tokens, an exponentially weighted mean, no fixed part.

Not thread-safe: their owner locks.
"""

from __future__ import annotations

import math
from collections import deque

OUTLIER = 4.0  # a sample this many times the median relative error is left out
NOISE = 0.05  # ... unless its relative error is within this (a fit that is all but exact)
SPREAD = 0.2  # token counts must differ by this share of the largest to fit the fixed part


class CostFit:
    """See the module docstring. ``step_tokens``: the tokens of one step (a
    prefill of more takes several; 0: one step whatever the tokens, for
    loads and for engines whose step is not known)."""

    def __init__(
        self, fixed_s: float, per_token_s: float, window: int = 64, step_tokens: int = 0
    ) -> None:
        if fixed_s < 0 or per_token_s < 0:
            raise ValueError("a cost's fixed and per-token parts must be >= 0")
        if window < 2:
            raise ValueError(f"a cost fit's window must hold >= 2 samples, got {window}")
        self.prior = (fixed_s, per_token_s)
        self.step_tokens = step_tokens
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.fixed_s, self.per_token_s = fixed_s, per_token_s
        self.samples = 0  # every sample taken, the window's and earlier ones
        self.left_out = 0  # samples of the window the last fit left out as outliers

    def steps(self, tokens: int) -> int:
        """Engine steps for ``tokens`` (at least one)."""
        if self.step_tokens <= 0 or tokens <= self.step_tokens:
            return 1
        return -(-tokens // self.step_tokens)

    def seconds(self, tokens: int) -> float:
        """The fitted time for ``tokens``."""
        return self.fixed_s * self.steps(tokens) + self.per_token_s * tokens

    def add(self, tokens: int, seconds: float) -> None:
        """One sample: ``tokens`` took ``seconds`` (a sample with no tokens or
        no positive, finite time is ignored)."""
        if tokens <= 0 or not (0 < seconds < math.inf):
            return
        self._samples.append((tokens, seconds))
        self.samples += 1
        self._fit()

    def status(self) -> dict[str, float | int]:
        return {
            "fixed_s": self.fixed_s,
            "per_token_s": self.per_token_s,
            "samples": self.samples,
            "window": len(self._samples),
            "left_out": self.left_out,
        }

    def _fit(self) -> None:
        rows = [(float(self.steps(n)), float(n), s) for n, s in self._samples]
        fixed, per_token = self._solve(rows)
        errors = [abs(self._error(row, fixed, per_token)) for row in rows]
        limit = max(OUTLIER * sorted(errors)[len(errors) // 2], NOISE)
        kept = [row for row, error in zip(rows, errors, strict=True) if error <= limit]
        self.left_out = 0
        if 2 <= len(kept) < len(rows):
            fixed, per_token = self._solve(kept)
            self.left_out = len(rows) - len(kept)
        self.fixed_s, self.per_token_s = fixed, per_token

    @staticmethod
    def _error(row: tuple[float, float, float], fixed: float, per_token: float) -> float:
        steps, tokens, seconds = row
        return (fixed * steps + per_token * tokens - seconds) / seconds

    def _solve(self, rows: list[tuple[float, float, float]]) -> tuple[float, float]:
        """Least relative squares: each row (steps, tokens, seconds) divided by
        its seconds, so ``1 ~= fixed x steps/s + per_token x tokens/s``."""
        tokens = [t for _, t, _ in rows]
        if max(tokens) - min(tokens) < SPREAD * max(tokens):
            return self.prior[0], self._rate_alone(rows, self.prior[0])
        a = b = c = d = e = 0.0  # sums of x1², x1·x2, x2², x1, x2 (y = 1)
        for steps, n, seconds in rows:
            x1, x2 = steps / seconds, n / seconds
            a += x1 * x1
            b += x1 * x2
            c += x2 * x2
            d += x1
            e += x2
        det = a * c - b * b
        if det <= 1e-12 * a * c:
            return self.prior[0], self._rate_alone(rows, self.prior[0])
        fixed = (d * c - e * b) / det
        per_token = (a * e - b * d) / det
        if per_token < 0:
            return self._fixed_alone(rows), 0.0
        if fixed < 0:
            return 0.0, self._rate_alone(rows, 0.0)
        return fixed, per_token

    @staticmethod
    def _rate_alone(rows: list[tuple[float, float, float]], fixed: float) -> float:
        """The per-token part that fits best with ``fixed`` held (at least 0)."""
        num = sum((n / s) * (1 - fixed * steps / s) for steps, n, s in rows)
        den = sum((n / s) ** 2 for _, n, s in rows)
        return max(num / den, 0.0)

    @staticmethod
    def _fixed_alone(rows: list[tuple[float, float, float]]) -> float:
        num = sum(steps / s for steps, _, s in rows)
        den = sum((steps / s) ** 2 for steps, _, s in rows)
        return max(num / den, 0.0)


class SingleRate:
    """Seconds over tokens, per sample, in an exponentially weighted mean
    (``ewma``), each sample clamped to [around / 100, around x 100] (``around``:
    the starting rate unless given): no fixed part (see the module docstring
    for what that costs)."""

    fixed_s = 0.0

    def __init__(self, per_token_s: float, ewma: float, around: float | None = None) -> None:
        self.around = per_token_s if around is None else around
        self.per_token_s = per_token_s
        self.ewma = ewma
        self.samples = 0

    def steps(self, tokens: int) -> int:
        return 1

    def seconds(self, tokens: int) -> float:
        return self.per_token_s * tokens

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds != seconds:  # no tokens, or NaN
            return
        sample = min(max(seconds / tokens, self.around / 100), self.around * 100)
        self.per_token_s = (1 - self.ewma) * self.per_token_s + self.ewma * sample
        self.samples += 1

    def status(self) -> dict[str, float | int]:
        return {"fixed_s": 0.0, "per_token_s": self.per_token_s, "samples": self.samples}


class ScaledCost:
    """``base`` times ``factor``: both parts."""

    def __init__(self, base: Learner, factor: float, samples: int) -> None:
        self.base = base
        self.factor = factor
        self.fixed_s = base.fixed_s * factor
        self.per_token_s = base.per_token_s * factor
        self.samples = samples  # the measurements the factor comes from

    def steps(self, tokens: int) -> int:
        return self.base.steps(tokens)

    def seconds(self, tokens: int) -> float:
        return self.base.seconds(tokens) * self.factor

    def status(self) -> dict[str, float | int]:
        return {
            "fixed_s": self.fixed_s,
            "per_token_s": self.per_token_s,
            "samples": self.samples,
            "factor": round(self.factor, 4),
        }


Learner = CostFit | SingleRate  # what takes samples
Estimator = Learner | ScaledCost  # what prices

__all__ = ["CostFit", "Estimator", "Learner", "ScaledCost", "SingleRate"]
