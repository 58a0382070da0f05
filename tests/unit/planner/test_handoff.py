"""``kvtier plan``'s prefill/decode hand-off budgets (issue 19, seed design
exercise 2), worked by hand on a Llama-3-8B-like shape: 32 layers, 8 KV
heads of 128, bf16 = 128 KiB a token."""

from __future__ import annotations

import json

import pytest

from kvtier.commands.cli import main
from kvtier.planner import ModelShape
from kvtier.planner.handoff import Handoff, plan_handoff
from kvtier.planner.plan import Deployment, Network

LLAMA = ModelShape(layers=32, kv_heads=8, head_dim=128)
GIB = 1 << 30
LINK = 200e9 / 8 * 0.7  # 200 Gbit/s at 70 %: 17.5 GB/s


def test_one_handoff_worked_by_hand() -> None:
    handoff = Handoff(pd_qps=2, pd_prompt_tokens=8000, pd_output_tokens=256, pd_itl_ms=30)
    plan = plan_handoff(LLAMA, Deployment(), Network(), handoff)
    assert plan.handoff_tokens == 8192  # the last partial chunk travels, padded to a chunk
    assert plan.written_bytes == plan.read_bytes == GIB
    assert plan.write_bytes_per_s == 2 * GIB
    assert plan.write_s == pytest.approx(GIB / LINK)  # 61.4 ms
    assert plan.lifetime_s == pytest.approx(2 * GIB / LINK + 0.050)
    assert plan.resident_bytes == pytest.approx(2 * plan.lifetime_s * GIB)  # Little's law
    assert plan.resident_bytes_bound == 2 * 30 * GIB  # nobody consumes: the 30 s lease
    assert plan.double_buffered_bytes == pytest.approx(2 * 2 * GIB / LINK * GIB)
    assert plan.decode_sequences == pytest.approx(2 * 256 * 0.030)  # 15.36
    # each holds 8,000 + 128 tokens on average, rounded up to 8,192
    assert plan.decode_kv_bytes == pytest.approx(15.36 * GIB)
    assert plan.layout == "same split"


def test_a_different_decode_tp_is_resharded_and_replication_counts() -> None:
    two_heads = ModelShape(layers=32, kv_heads=2, head_dim=128)
    plan = plan_handoff(two_heads, Deployment(tp=2), Network(), Handoff(decode_tp=4))
    assert (plan.prefill_tp, plan.decode_tp, plan.layout) == (2, 4, "re-sharded by KV heads")
    assert plan.read_bytes == 2 * plan.written_bytes  # TP 4 keeps each of 2 heads twice
    # The server holds the producer's split for the whole hand-off, the re-sharded one
    # from the take through the read.
    held = plan.lifetime_s * plan.written_bytes + plan.read_s * plan.read_bytes
    assert plan.resident_bytes == pytest.approx(1.0 * held)  # 1 hand-off a second


def test_an_mla_latent_goes_to_every_rank() -> None:
    mla = ModelShape(layers=61, mla_latent_dim=512, mla_rope_dim=64)
    plan = plan_handoff(mla, Deployment(tp=1), Network(), Handoff(decode_tp=8))
    assert plan.layout == "latent copied to every rank"
    assert plan.read_bytes == 8 * plan.written_bytes


def test_the_command_reports_it_apart_from_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pd-qps", "2"]
    assert main(["plan", *flags, "--decode-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Prefill/decode hand-off (this request's KV; reuse is above)" in out
    assert "read by decode, TP 1 -> 2 (re-sharded by KV heads)" in out
    assert main(["plan", *flags, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["handoff"]["written_bytes"] == GIB and "read_bytes_per_s" in report
    assert main(["plan", *flags[:6]]) == 0
    assert "hand-off" not in capsys.readouterr().out  # no --pd-qps: no hand-off section


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--decode-tp 2", "--decode-tp needs --pd-qps"),
        ("--pd-qps 1 --decode-tp 3", "--decode-tp 3: --tp 3 does not divide"),
        ("--pd-qps 0", "--pd-qps must be positive"),
        ("--pd-qps 1 --handoff-lease-s 0", "--handoff-lease-s must be positive"),
    ],
)
def test_bad_handoff_flags_name_the_flag(
    flags: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    assert main([*base, *flags.split()]) == 2
    assert message in capsys.readouterr().err
