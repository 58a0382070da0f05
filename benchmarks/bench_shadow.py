"""The shadow check (``kvtier.engine.shadow``) on the transformers integration:
its error on honest reuse, whether it catches wrong KV, and what it costs.

``--prompts`` prompts, each a prefix of ``--prefix-chunks`` 256-token chunks of
its own and a 64-token suffix, through one in-process ``StorageManager``:

- stored once (cold), then prefilled warm twice with a new suffix each time:
  once with every hit sampled (``ShadowCheck(1.0)``) and once without, the
  order alternating prompt by prompt. Reported: the relative error of each
  checked chunk (max and median), mismatches (must be 0), and the warm TTFT
  with the check against without (the prompt still uses the loaded chunk;
  the check recomputes that chunk of 256 tokens on top, and ``prefill``
  returns after it).
- crossed: the lookup of each prompt is answered with the previous prompt's
  KV (what a metadata mix-up would serve: every checksum passes). Reported:
  the share of those chunks the check flags (must be all).

Exits 1 when honest reuse is flagged or wrong KV is not.

Run for the demo model (15.5 M parameters) in float32 and in bfloat16, whose
rounding the default tolerance (0.02) must absorb.

    python benchmarks/bench_shadow.py [--prompts 100] [--prefix-chunks 4] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common import report
from kvtier.engine.hf import KVTierModel
from kvtier.engine.link import CacheLink, Hit
from kvtier.engine.shadow import ShadowCheck
from kvtier.l1 import L1Config
from kvtier.models import demo_model
from kvtier.storage import StorageConfig, StorageManager

CHUNK = 256
SUFFIX = 64


class CrossedLink:
    """A link whose lookups are answered with the previous lookup's chunks:
    another prompt's KV, intact, under this prompt's request."""

    def __init__(self, link: CacheLink) -> None:
        self._link = link
        self._previous: list[bytes] | None = None

    def lookup(self, request_id: str, hashes: Sequence[bytes]) -> Hit:
        served = self._previous if self._previous is not None else list(hashes)
        self._previous = list(hashes)
        return self._link.lookup(request_id, served)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


def measure(
    dtype: torch.dtype, prompts: int, prefix_chunks: int, seed: int, model_dir: Path | None
) -> dict[str, Any]:
    model, _ = demo_model(model_dir)
    model = model.to(dtype)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(vocab) for _ in range(prefix_chunks * CHUNK)] for _ in range(prompts)
    ]

    def suffix() -> list[int]:
        return [rng.randrange(vocab) for _ in range(SUFFIX)]

    shadow = ShadowCheck(1.0, seed=seed)
    config = StorageConfig(l1=L1Config(size_bytes=1 << 30, populate=False))
    with StorageManager(config) as storage:
        checked = KVTierModel(model, storage=storage, chunk_size=CHUNK, shadow=shadow)
        plain = KVTierModel(model, storage=storage, chunk_size=CHUNK)
        for prefix in prefixes:
            assert plain.prefill(prefix + suffix()).stored_tokens == len(prefix)
        errors, with_check, without = [], [], []
        for i, prefix in enumerate(prefixes):
            order = [(checked, with_check), (plain, without)]
            for engine, ttfts in order if i % 2 else order[::-1]:
                result = engine.prefill(prefix + suffix())
                assert result.hit_tokens == len(prefix), result.miss_reason
                ttfts.append(result.timings.ttft_s)
                if engine is checked:
                    assert result.shadow_error is not None
                    errors.append(result.shadow_error)
        honest = shadow.stats()
        checked.link = CrossedLink(checked.link)  # type: ignore[assignment,arg-type]
        crossed = []
        for prefix in [*prefixes, prefixes[0]]:
            result = checked.prefill(prefix + suffix())
            crossed.append(result.shadow_error)
        crossed = crossed[1:]  # the first lookup was served its own KV
    return {
        "honest_checked": honest.checked_chunks,
        "honest_mismatched": honest.mismatched_chunks,
        "error_max": max(errors),
        "error_median": statistics.median(errors),
        "ttft_with_check_s": statistics.median(with_check),
        "ttft_without_s": statistics.median(without),
        "crossed_checked": sum(e is not None for e in crossed),
        "crossed_flagged": sum(e is not None and not e <= shadow.tolerance for e in crossed),
        "crossed_error_min": min(e for e in crossed if e is not None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--prefix-chunks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, help="where the model is cached")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    results, rows = {}, []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        r = measure(dtype, args.prompts, args.prefix_chunks, args.seed, args.model_dir)
        results[name] = r
        rows += [
            (
                f"{name}: honest reuse, relative error",
                f"max {r['error_max']:.2e}, median {r['error_median']:.2e}; "
                f"{r['honest_mismatched']} of {r['honest_checked']} flagged",
            ),
            (
                f"{name}: another prompt's KV served",
                f"{r['crossed_flagged']} of {r['crossed_checked']} flagged "
                f"(smallest error {r['crossed_error_min']:.2f})",
            ),
            (
                f"{name}: warm TTFT with the check / without",
                f"{r['ttft_with_check_s'] * 1e3:.1f} / {r['ttft_without_s'] * 1e3:.1f} ms "
                f"({r['ttft_with_check_s'] / r['ttft_without_s']:.2f}x)",
            ),
        ]
    failed = [
        name
        for name, r in results.items()
        if r["honest_mismatched"] or r["crossed_flagged"] < r["crossed_checked"]
    ]
    report(
        f"shadow check, {args.prompts} prompts of {args.prefix_chunks} x {CHUNK} + {SUFFIX} tokens",
        rows,
        results,
    )
    if failed:
        raise SystemExit(f"the shadow check misjudged reuse in {', '.join(failed)}")


if __name__ == "__main__":
    main()
