"""The run-time quality gate for lossy reuse: a sampled shadow full prefill.

Blended prefills (CacheBlend) and KV stored with a lossy codec give
approximate KV, measured offline on one model (``kvtier blend-eval``). A
model on which moving K is subtly wrong, or a codec too coarse for its
value ranges, would garble outputs silently. So, for a ``fraction`` of the
prompts a lossy path serves, the engine also runs full prefill and compares
the next-token distributions at the prompt's end: *top-1 agreement* (the
same argmax) and ``KL(full || lossy)`` in nats.

Each *namespace* (the model's identity and the lossy path: ``blend``,
``codec:int8``...) keeps a running verdict over its last ``window`` samples:

```
        samples >= min_samples and
        (agreement < min_agreement or mean KL > max_kl)
   ON ------------------------------------------------------> OFF
```

OFF is final for the process: that namespace's requests fall back to exact
reuse (prefix chunks) or recompute, the trip is counted, logged once and
reported to the cache server (its ``/status``, ``/metrics`` and dashboard
show every engine's verdicts). A sampled prompt is answered from its full
prefill (it was computed anyway). The cost is ``fraction`` of the lossy
prompts prefilled twice.

Thread-safe: one lock guards the verdicts and the sampling generator.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from collections import deque
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class GateState(enum.StrEnum):
    ON = "on"  # the lossy path serves
    OFF = "off"  # quality fell below the thresholds: exact reuse or recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class QualityGateConfig:
    fraction: float = 0.05  # share of lossy prompts also prefilled in full, in (0, 1]
    min_agreement: float = 0.8  # the running top-1 agreement must stay >= this, in (0, 1)
    max_kl: float = 0.5  # the running mean KL(full || lossy), nats, must stay <= this, in (0, 1)
    window: int = 32  # samples in the running verdict
    min_samples: int = 8  # no verdict before this many samples
    seed: int | None = None  # the sampling generator's (None: from the system)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"quality gate fraction must be in (0, 1], got {self.fraction}")
        for name in ("min_agreement", "max_kl"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"quality gate {name} must be in (0, 1), got {value}")
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError(
                f"quality gate needs window >= 1 and 1 <= min_samples <= window, got "
                f"window {self.window}, min_samples {self.min_samples}"
            )


@dataclass(frozen=True, slots=True)
class Sample:
    """One shadow comparison at a prompt's last position."""

    agreed: bool
    kl: float


@dataclass(slots=True)
class Verdict:
    """A namespace's running verdict (``samples``/``agreed``/``kl_sum``: all
    its samples; the thresholds apply to ``recent``, the last ``window``)."""

    recent: deque[Sample]  # bounded: deque(maxlen=window)
    state: GateState = GateState.ON
    samples: int = 0
    agreed: int = 0
    kl_sum: float = 0.0
    tripped_at: int | None = None  # the sample that turned it off

    def agreement(self) -> float:
        return sum(s.agreed for s in self.recent) / max(1, len(self.recent))

    def mean_kl(self) -> float:
        return sum(s.kl for s in self.recent) / max(1, len(self.recent))


def compare(lossy: torch.Tensor, full: torch.Tensor) -> Sample:
    """Compare two next-token logit vectors ``[vocab]``."""
    lossy, full = lossy.float().reshape(-1), full.float().reshape(-1)
    if lossy.shape != full.shape:
        raise ValueError(f"quality gate: logits {tuple(lossy.shape)} != {tuple(full.shape)}")
    log_p, log_q = full.log_softmax(-1), lossy.log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    agreed = int(lossy.argmax()) == int(full.argmax())
    return Sample(agreed, kl if kl == kl else float("inf"))  # NaN logits: as bad as it gets


class QualityGate:
    """Verdicts by namespace; see the module docstring."""

    def __init__(self, config: QualityGateConfig | None = None) -> None:
        self.config = config or QualityGateConfig()
        self._random = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._verdicts: dict[str, Verdict] = {}

    def allows(self, namespace: str) -> bool:
        """Whether the lossy path may serve this namespace."""
        with self._lock:
            verdict = self._verdicts.get(namespace)
            return verdict is None or verdict.state is GateState.ON

    def sample(self) -> bool:
        """Whether to shadow this lossy prompt (a ``fraction`` of the calls)."""
        with self._lock:
            return self._random.random() < self.config.fraction

    def observe(self, namespace: str, sample: Sample) -> Verdict:
        """Count a sample; turns the namespace OFF (logged once) when its
        running verdict falls below a threshold. Returns the verdict now."""
        config = self.config
        with self._lock:
            verdict = self._verdicts.get(namespace)
            if verdict is None:
                verdict = self._verdicts[namespace] = Verdict(deque(maxlen=config.window))
            verdict.samples += 1
            verdict.agreed += sample.agreed
            verdict.kl_sum += sample.kl
            verdict.recent.append(sample)
            failing = verdict.agreement() < config.min_agreement or not (
                verdict.mean_kl() <= config.max_kl
            )
            tripped = (
                verdict.state is GateState.ON
                and len(verdict.recent) >= config.min_samples
                and failing
            )
            if tripped:
                verdict.state, verdict.tripped_at = GateState.OFF, verdict.samples
                seen = (
                    verdict.samples,
                    len(verdict.recent),
                    verdict.agreement(),
                    verdict.mean_kl(),
                )
        if tripped:
            log.warning(
                "quality gate: %s turned off after %d samples (over the last %d: top-1 agreement "
                "%.3f, at least %.3f asked; mean KL %.4f nats, at most %.4f asked); its prompts "
                "get exact reuse or recompute",
                namespace,
                seen[0],
                seen[1],
                seen[2],
                config.min_agreement,
                seen[3],
                config.max_kl,
            )
        return verdict

    def status(self) -> dict[str, dict[str, object]]:
        """Per namespace: state, samples, agreed, mean KL, running agreement."""
        with self._lock:
            return {
                namespace: {
                    "state": str(v.state),
                    "samples": v.samples,
                    "agreed": v.agreed,
                    "mean_kl": v.kl_sum / max(1, v.samples),
                    "running_agreement": v.agreement(),
                    "running_kl": v.mean_kl(),
                    "tripped_at": v.tripped_at,
                }
                for namespace, v in self._verdicts.items()
            }
