"""TTFT of the transformers integration: full prefill, kvtier miss, kvtier hit,
and the ideal, for a cached prefix plus new tokens.

For each prefix length (tokens, a multiple of the server's 256-token chunk),
every round runs, in turn, on prompts of ``prefix + suffix`` tokens:

- ``full``: no cache, the whole prompt (the baseline).
- ``miss``: through a kvtier server, a prompt nothing in the cache shares, so
  kvtier only adds its lookup and the store of every full chunk.
- ``hit``: through the server, the cached prefix and a new suffix: lookup,
  copy of the prefix's KV from the server's arena, and the suffix's prefill.
- ``ideal``: the suffix's prefill on top of the prefix's KV already in a
  ``DynamicCache`` in this process (copied before the timer starts).

The model is ``kvtier demo``'s (15.5 M parameters, fp32); the server runs in
a child process with a 512 MiB L1 and no L2. Reported: medians, and the
median of the per-round ratios ``hit/ideal`` and ``miss/full``.

    python benchmarks/bench_hf_ttft.py [--prefix 2048 8192] [--suffix 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from common import report, timed
from kvtier.engine.hf import KVTierModel, cache_argument
from kvtier.models import demo_model
from kvtier.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model-dir", type=Path, help="where the demo model is cached")
    args = parser.parse_args()
    model, _ = demo_model(args.model_dir)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {"suffix_tokens": args.suffix, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-hf-") as tmp:
        server = ServerProcess.start(
            ["--port", "0", "--http-port", "-1", "--l1-size", "512MiB", "--cache-dir", "none"],
            Path(tmp) / "server.log",
        )
        try:
            reference = KVTierModel(model)
            with KVTierModel(model, server=server.rpc, name="bench/hf-ttft") as cached:
                for prefix_tokens in args.prefix:
                    measured = measure(reference, cached, tokens, prefix_tokens, args)
                    results[f"prefix_{prefix_tokens}"] = measured
                    rows += summarize(prefix_tokens, args.suffix, measured)
        finally:
            server.stop()
    report("transformers TTFT: full prefill vs kvtier miss/hit vs ideal", rows, results)


def measure(
    reference: KVTierModel,
    cached: KVTierModel,
    tokens: Callable[[int], list[int]],
    prefix_tokens: int,
    args: argparse.Namespace,
) -> dict[str, object]:
    prefix = tokens(prefix_tokens)
    cached.prefill(prefix)  # store the prefix
    prefix_cache = reference.prefill(prefix).cache  # the ideal's KV, in memory
    reference.prefill(tokens(prefix_tokens + args.suffix))  # one-off costs of this shape
    samples: dict[str, list[float]] = {"full": [], "miss": [], "hit": [], "ideal": []}
    breakdown: dict[str, list[float]] = {"lookup": [], "load": [], "prefill": [], "store": []}
    hit_tokens = []
    for _ in range(args.rounds):
        suffix = tokens(args.suffix)
        fresh = tokens(prefix_tokens + args.suffix)
        samples["full"].append(timed(lambda fresh=fresh: reference.prefill(fresh)))
        miss = cached.prefill(tokens(prefix_tokens + args.suffix))
        samples["miss"].append(miss.timings.ttft_s)
        hit = cached.prefill(prefix + suffix)
        samples["hit"].append(hit.timings.ttft_s)
        hit_tokens.append(hit.hit_tokens)
        for step in breakdown:
            breakdown[step].append(getattr(hit.timings, f"{step}_s"))
        kv = copy.deepcopy(prefix_cache)
        samples["ideal"].append(
            timed(lambda kv=kv, suffix=suffix: ideal(reference.model, suffix, kv))
        )
    ratios = {
        "hit_over_ideal": [h / i for h, i in zip(samples["hit"], samples["ideal"], strict=True)],
        "miss_over_full": [m / f for m, f in zip(samples["miss"], samples["full"], strict=True)],
        "full_over_hit": [f / h for f, h in zip(samples["full"], samples["hit"], strict=True)],
    }
    return {
        **{f"{k}_s": statistics.median(v) for k, v in samples.items()},
        **{f"{k}_median": statistics.median(v) for k, v in ratios.items()},
        **{f"hit_{k}_s": statistics.median(v) for k, v in breakdown.items()},
        "hit_tokens": min(hit_tokens),
        "samples": samples,
    }


@torch.inference_mode()
def ideal(model: PreTrainedModel, suffix: list[int], cache: DynamicCache) -> None:
    """The suffix's prefill on top of ``cache``, straight through transformers."""
    kwargs = {cache_argument(model): cache}
    model(input_ids=torch.tensor([suffix]), use_cache=True, logits_to_keep=1, **kwargs)


def summarize(prefix: int, suffix: int, m: dict[str, object]) -> list[tuple[str, str]]:
    def ms(key: str) -> str:
        value = m[key]
        assert isinstance(value, float)
        return f"{value * 1e3:.1f} ms"

    return [
        (f"{prefix}+{suffix}: full prefill", ms("full_s")),
        (
            f"{prefix}+{suffix}: kvtier miss",
            f"{ms('miss_s')} ({m['miss_over_full_median']:.2f}x full)",
        ),
        (f"{prefix}+{suffix}: ideal (KV in memory)", ms("ideal_s")),
        (
            f"{prefix}+{suffix}: kvtier hit",
            f"{ms('hit_s')} ({m['hit_over_ideal_median']:.2f}x ideal, "
            f"{m['full_over_hit_median']:.1f}x faster than full; lookup {ms('hit_lookup_s')}, "
            f"load {ms('hit_load_s')}, prefill {ms('hit_prefill_s')})",
        ),
    ]


if __name__ == "__main__":
    main()
