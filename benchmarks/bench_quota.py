"""What tenant quotas cost: L1 store and lookup throughput through
``StorageManager`` with and without per-tenant owners and limits.

Three configurations over the same keys (4 tenants by salt, 64-object
batches of 16 KiB objects, L1 big enough that nothing is evicted):

- *no owners* — the baseline, measured in the same run;
- *owners, limits not reached* — every store pays the owner accounting and
  the hard-limit check (the cost of enforcement itself);
- *owners over a soft limit* — every store also evicts the tenant's own
  oldest objects (scoped eviction), measured against *no owners* with an L1
  small enough that global eviction does the same amount of work.

Rounds run the configurations in turn, the order rotated each round, so that
drift and position effects fall on all; each ratio is taken within a round
(paired) and the median of the rounds reported, with their middle half.

    python benchmarks/bench_quota.py [--rounds 7] [--batches 200]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import report, timed
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.l1.quotas import OwnerLimit
from kvtier.storage import Owners, StorageConfig, StorageManager

OBJECT = 16 << 10
BATCH = 64
TENANTS = ("acme", "globex", "initech", "umbrella")


def run(batches: int, owners: dict[str, OwnerLimit] | None, l1_bytes: int) -> tuple[float, float]:
    """(stores/s, lookups/s) in objects per second."""
    config = StorageConfig(l1=L1Config(size_bytes=l1_bytes, populate=True, high_watermark=0.95))
    data = [np.full(OBJECT, 7, np.uint8)] * BATCH
    tenants = None if owners is None else Owners(lambda salt: salt, owners)
    with StorageManager(config, owners=tenants) as storage:
        storage.wait_mapped(60)
        batches_keys = [
            [
                ObjectKey((b * BATCH + i).to_bytes(32, "big"), "bench", 0, 0, TENANTS[b % 4])
                for i in range(BATCH)
            ]
            for b in range(batches)
        ]
        stored = timed(lambda: [storage.store(keys, data) for keys in batches_keys])
        survivors = [k for k in batches_keys if storage.in_l1(k[0])]

        def lookups() -> None:
            for keys in survivors:
                hit = storage.lookup(keys).hit_chunks
                storage.release(keys[:hit])

        looked = timed(lookups)
    return batches * BATCH / stored, len(survivors) * BATCH / max(looked, 1e-9)


def spread(ratios: list[float]) -> str:
    """The middle half of per-round ratios, e.g. '[0.97-1.02]'."""
    if len(ratios) < 4:
        return ""
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"[{q1:.2f}-{q3:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    total = args.batches * BATCH * (OBJECT + 4096)
    roomy = 2 * total
    # a quarter of the objects fit: evictions on every store in both configurations
    tight = total // 4
    per_tenant = OwnerLimit(soft=tight // 4 // 2)  # well under the arena: own evictions decide
    configs = {
        "no owners": (None, roomy),
        "owners, under limits": ({t: OwnerLimit(hard=roomy, pins=0) for t in TENANTS}, roomy),
        "no owners, L1 evicting": (None, tight),
        "owners over soft limits": ({t: per_tenant for t in TENANTS}, tight),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
            owners, size = configs[name]
            samples[name].append(run(args.batches, owners, size))
    baseline = {name: "no owners, L1 evicting" if "evicting" in name or "soft" in name
                else "no owners" for name in configs}  # fmt: skip
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"object_bytes": OBJECT, "batch": BATCH, "samples": samples}
    for name, got in samples.items():
        base = samples[baseline[name]]
        # ratios paired within a round (the same minute of the machine), then their median
        store_ratios = [s / b for (s, _), (b, _) in zip(got, base, strict=True)]
        lookup_ratios = [lk / b for (_, lk), (_, b) in zip(got, base, strict=True)]
        store = statistics.median(s for s, _ in got)
        lookup = statistics.median(lk for _, lk in got)
        rows.append(
            (name,
             f"store {store:,.0f} obj/s ({statistics.median(store_ratios):.3f}x "
             f"{spread(store_ratios)})  lookup {lookup:,.0f} obj/s "
             f"({statistics.median(lookup_ratios):.3f}x {spread(lookup_ratios)})")
        )  # fmt: skip
        results[name] = {
            "stores_per_s": store,
            "lookups_per_s": lookup,
            "store_ratio": statistics.median(store_ratios),
            "lookup_ratio": statistics.median(lookup_ratios),
            "store_ratios": store_ratios,
            "lookup_ratios": lookup_ratios,
        }
    report("Tenant quotas in L1: throughput against no owners", rows, results)


if __name__ == "__main__":
    main()
