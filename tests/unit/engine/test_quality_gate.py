"""The quality gate for lossy reuse (``kvtier.engine.quality_gate``): its
settings refused out of range, the comparison, the running verdict (when it
trips, logged once, final), and through ``KVTierModel``: a sampled blend or
lossy load answered from full prefill, a path the gate turned off served
exactly (prefix reuse or recompute), and a gate that never trips where the
lossy path is exact."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from kvtier.blend import BlendConfig
from kvtier.engine.hf import KVTierModel
from kvtier.engine.quality_gate import (
    GateState,
    QualityGate,
    QualityGateConfig,
    Sample,
    compare,
)
from kvtier.storage import StorageManager
from tests.hf_helpers import TOLERANCE, PerturbingLink, prompt, tiny_model
from tests.unit.engine.test_segments import CHUNK, PARTS, joined


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"min_agreement": 0.0}, "min_agreement must be in (0, 1)"),
        ({"min_agreement": 1.0}, "min_agreement must be in (0, 1)"),
        ({"max_kl": 0.0}, "max_kl must be in (0, 1)"),
        ({"max_kl": 1.5}, "max_kl must be in (0, 1)"),
        ({"max_kl": float("nan")}, "max_kl must be in (0, 1)"),
        ({"fraction": 0.0}, "fraction must be in (0, 1]"),
        ({"fraction": 1.1}, "fraction must be in (0, 1]"),
        ({"window": 4, "min_samples": 5}, "min_samples <= window"),
        ({"min_samples": 0}, "min_samples <= window"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(
    options: dict[str, float], says: str
) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        QualityGateConfig(**options)  # type: ignore[arg-type]


def test_compare_gives_agreement_and_kl_and_nan_is_the_worst() -> None:
    logits = torch.tensor([1.0, 3.0, 0.5])
    assert compare(logits, logits) == Sample(True, pytest.approx(0.0, abs=1e-7))  # type: ignore[arg-type]
    moved = compare(torch.tensor([3.0, 1.0, 0.5]), logits)
    assert not moved.agreed and moved.kl > 0.5
    assert compare(torch.full((3,), float("nan")), logits).kl == float("inf")
    with pytest.raises(ValueError, match="logits"):
        compare(torch.zeros(4), logits)


def test_the_verdict_trips_on_its_running_agreement_once_and_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.quality_gate")
    gate = QualityGate(QualityGateConfig(min_agreement=0.6, window=4, min_samples=3))
    for _ in range(6):
        assert gate.observe("m/blend", Sample(True, 0.1)).state is GateState.ON
    # The window [T, T, T, F] agrees 0.75, [T, T, F, F] 0.5: off at the 8th sample.
    assert gate.observe("m/blend", Sample(False, 0.1)).state is GateState.ON
    verdict = gate.observe("m/blend", Sample(False, 0.1))
    assert (verdict.state, verdict.tripped_at) == (GateState.OFF, 8)
    for _ in range(10):  # good samples again: it stays off, and is not logged again
        gate.observe("m/blend", Sample(True, 0.0))
    assert not gate.allows("m/blend") and gate.allows("m/codec:int8")
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
    status = gate.status()["m/blend"]
    assert (status["state"], status["samples"], status["tripped_at"]) == ("off", 18, 8)


def test_the_verdict_trips_on_mean_kl_only_from_min_samples() -> None:
    gate = QualityGate(QualityGateConfig(max_kl=0.5, window=8, min_samples=3))
    states = [gate.observe("m/blend", Sample(True, 0.9)).state for _ in range(3)]
    assert states == [GateState.ON, GateState.ON, GateState.OFF]


def test_a_fraction_of_prompts_is_sampled() -> None:
    gate = QualityGate(QualityGateConfig(fraction=0.25, seed=3))
    assert 900 <= sum(gate.sample() for _ in range(4000)) <= 1100


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama", num_hidden_layers=4)


def strict(**options: float) -> QualityGate:
    """A gate sampling every prompt, off at the first bad pair of samples."""
    config = {"fraction": 1.0, "min_agreement": 0.99, "max_kl": 1e-6, "window": 2}
    return QualityGate(QualityGateConfig(**{**config, "min_samples": 2, **options}))  # type: ignore[arg-type]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOLERANCE


def test_a_blend_below_the_bar_turns_blending_off_and_exact_reuse_serves(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    ids, spans = joined(PARTS)
    reference = KVTierModel(llama).prefill(ids).logits
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK, quality_gate=strict())
    for n in range(2):  # ratio 0: plain concatenation, far from full prefill
        got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0))
        assert got.gate == "shadowed" and got.quality is not None and got.quality.kl > 1e-6
        assert got.blend is not None and close(got.logits, reference)  # full prefill's answer
        assert engine.quality_gate is not None
        assert engine.quality_gate.allows(engine._gate_namespace("blend")) == (n == 0)
    for n in range(2):  # off: computed, its prefix chunks stored, then reused
        off = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0))
        assert (off.gate, off.blend, off.quality) == ("off", None, None)
        assert close(off.logits, reference) and (off.hit_tokens > 0) == (n == 1)


def test_a_blend_at_ratio_one_is_exact_and_never_trips_the_gate(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK, quality_gate=strict())
    for seed in range(4):
        ids, spans = joined([prompt(10 * seed + i, n) for i, n in enumerate((12, 20, 30, 7))])
        got = engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=1.0))
        assert got.gate == "shadowed" and got.quality is not None and got.quality.agreed
    assert engine.quality_gate is not None
    assert engine.quality_gate.allows(engine._gate_namespace("blend"))


def test_lossy_loads_that_garble_turn_the_codec_off_and_prompts_are_recomputed(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    """Under a lossy codec a hit is lossy KV: loads perturbed far beyond what
    int8 does trip the gate; then prompts are recomputed, bit for bit."""
    ids = prompt(7, 4 * CHUNK + 3)
    reference = KVTierModel(llama).prefill(ids).logits
    engine = KVTierModel(
        llama, storage=storage, chunk_size=CHUNK, lossy_codec="int8", quality_gate=strict()
    )
    assert engine.prefill(ids).gate == ""  # a miss: nothing lossy to check
    engine.link = PerturbingLink(engine.link, delta=3.0)
    gates = [engine.prefill(ids).gate for _ in range(3)]
    assert gates == ["shadowed", "shadowed", "off"]
    off = engine.prefill(ids)
    assert (off.hit_tokens, off.computed_tokens) == (0, len(ids))
    assert torch.equal(off.logits, reference)
