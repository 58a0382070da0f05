"""The quality gate on the real model, SmolLM2-135M-Instruct, every prompt
sampled, every document stored as a segment first (so each blend finds its
documents and moves them): at blend ratio 0.5 it never turns blending off
over 100 prompts of the retrieval task; with blending deliberately broken
(documents computed alone, nothing recomputed, K moved by a wrong rotation,
as for a model whose RoPE kvtier misread) it turns off within
``BROKEN_WITHIN`` samples, the engine then serves exact reuse, and the cache
server shows the verdict.

Shorter documents than ``kvtier blend-eval``'s (30-60 words, 2-3 a prompt)
keep the 100 prompts within a few minutes on CI;
``benchmarks/bench_quality_gate.py`` measures the default task."""

from __future__ import annotations

from typing import Any
from unittest import mock

from transformers import LlamaForCausalLM

from kvtier.bench.blend.evaluation import warm_segments
from kvtier.bench.retrieval import RetrievalSpec, document_pool, retrieval_prompts, tokenize
from kvtier.blend import BlendConfig, RopeShift
from kvtier.engine.hf import KVTierModel
from kvtier.engine.quality_gate import QualityGate, QualityGateConfig
from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager
from tests.integration import test_smollm2 as real_model
from tests.integration.harness import ServerFactory, wait_for

# The real model's markers (slow, engine, skipped without the wheel) and fixture.
pytestmark = real_model.pytestmark
loaded = real_model.loaded

SPEC = RetrievalSpec(prompts=100, pool=12, documents=(2, 3), words=(30, 60), seed=5)
GATE = QualityGateConfig(fraction=1.0, seed=0)  # the default thresholds, every prompt sampled
BROKEN_WITHIN = 12  # samples: min_samples (8) plus a margin


def test_blending_at_ratio_half_never_trips_the_gate_over_100_prompts(
    loaded: tuple[LlamaForCausalLM, Any],
) -> None:
    model, tokenizer = loaded
    gate = QualityGate(GATE)
    pool = document_pool(SPEC)
    with StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 30))) as storage:
        warm_segments(KVTierModel(model, storage=storage, chunk_size=256), tokenizer, pool)
        engine = KVTierModel(model, storage=storage, chunk_size=256, quality_gate=gate)
        gates = []
        for prompt in retrieval_prompts(SPEC, pool):
            ids, spans = tokenize(prompt, tokenizer)
            gates.append(engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.5)).gate)
    (verdict,) = gate.status().values()
    assert gates == ["shadowed"] * 100, verdict
    assert verdict["state"] == "on" and verdict["samples"] == 100, verdict


def test_broken_blending_trips_the_gate_and_the_server_shows_it(
    loaded: tuple[LlamaForCausalLM, Any], kvtier_server: ServerFactory
) -> None:
    model, tokenizer = loaded
    server = kvtier_server.start("--chunk-size", "256", l1_size="512MiB")
    right = RopeShift.of(model)
    broken = RopeShift(right.inv_freq * 1.5, right.rope_type)
    gate = QualityGate(GATE)
    pool = document_pool(SPEC)
    plain = KVTierModel(model, server=server.rpc, name="smollm2")
    engine = KVTierModel(model, server=server.rpc, name="smollm2", quality_gate=gate)
    broken_blend = BlendConfig(ratio=0.0, anchor=False)
    gates: list[str] = []
    try:
        with mock.patch.object(RopeShift, "of", return_value=broken):
            warm_segments(plain, tokenizer, pool, anchors=(False,))
            for prompt in retrieval_prompts(SPEC, pool)[: BROKEN_WITHIN + 2]:
                ids, spans = tokenize(prompt, tokenizer)
                gates.append(engine.prefill(ids, segments=spans, blend=broken_blend).gate)
    finally:
        plain.close()
        engine.close()
    first_off = gates.index("off")  # the prompt after the sample that tripped it
    assert GATE.min_samples <= first_off <= BROKEN_WITHIN, gates
    assert gates[first_off:] == ["off"] * (len(gates) - first_off)

    def rows() -> list[dict[str, Any]]:
        return list(server.status()["quality"])

    (row,) = wait_for(rows, lambda r: bool(r) and r[0]["samples"] == first_off)
    assert (row["path"], row["off"], row["samples"]) == ("blend", True, first_off), row
    assert "turned 'blend' off" in server.log
