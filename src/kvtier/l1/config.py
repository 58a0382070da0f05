"""``L1Config``: the L1 manager's settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.l1.policies import EVICTION_POLICIES
from kvtier.l1.region import DEFAULT_SHM_DIR

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class L1Config:
    """Settings of one L1 manager. Sizes in bytes, durations in seconds.

    Eviction starts when used bytes (resident + staging) pass
    ``high_watermark`` of the capacity and stops at ``low_watermark``.
    Leases are a crash net for holders that vanish, not a normal release path.
    """

    size_bytes: int = 4 * GiB
    shm_dir: str = DEFAULT_SHM_DIR
    populate: bool = True
    reaper: bool = False  # a child process removes the arena's file if this one dies
    eviction_policy: str = "lru"
    high_watermark: float = 0.8
    low_watermark: float = 0.6
    write_lease_s: float = 600.0
    read_lease_s: float = 300.0
    max_pinned_fraction: float = 0.5  # of the arena, all owners' pins together

    def __post_init__(self) -> None:
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int):
            raise TypeError(f"L1Config.size_bytes must be an int, got {self.size_bytes!r}")
        if self.size_bytes < 4096:
            raise ValueError(f"L1Config.size_bytes must be at least 4096, got {self.size_bytes}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"L1Config.eviction_policy {self.eviction_policy!r} is not one of "
                f"{sorted(EVICTION_POLICIES)}"
            )
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ValueError(
                "L1Config watermarks must satisfy 0 < low_watermark < high_watermark <= 1, "
                f"got low={self.low_watermark}, high={self.high_watermark}"
            )
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"L1Config.max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        for name in ("write_lease_s", "read_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"L1Config.{name} must be > 0, got {getattr(self, name)!r}")
