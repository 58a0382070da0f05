"""``make_plan`` against numbers worked out by hand: the seed's design
exercise (§1.2-§1.3, Q42) exactly, then an MLA model, GQA with TP beyond its KV
heads, a sliding-window model, pipeline stages and a recurrent hybrid."""

from __future__ import annotations

import math
import re

import pytest

from kvtier.planner import (
    Compute,
    Deployment,
    ModelShape,
    Network,
    Workload,
    make_plan,
    prefill_flops,
    transfer_seconds,
)
from kvtier.planner.plan import Plan, split_kv_heads, stage_layers

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

SEED_MODEL = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype="bf16")


def seed_plan(**compute: float) -> Plan:
    return make_plan(
        SEED_MODEL,
        Deployment(tp=4, chunk_size=256, replicas=2, utilization=0.7),
        Workload(prefix_tokens=6144, prefixes=1000, qps=20, write_fraction=0.1, write_tokens=8192),
        Network(nic_gbps=200, nic_efficiency=0.7, staging_ms=100),
        Compute(**compute),
    )


def test_seed_design_exercise_exactly() -> None:
    plan = seed_plan()
    assert plan.bytes_per_token == 128 * KiB  # 2 x 32 x 8 x 128 x 2 B
    assert plan.bytes_per_prefix == 0.75 * GiB  # 6144 x 128 KiB
    assert plan.total_bytes == 750 * GiB
    assert plan.tp_replication == 1  # TP 4 over 8 KV heads: 2 heads per rank
    assert plan.stored_bytes == 750 * GiB
    assert plan.replicated_bytes == 1500 * GiB
    assert plan.pool_bytes == pytest.approx(1500 * GiB / 0.7)
    assert round(plan.pool_bytes / GiB, 1) == 2142.9
    assert plan.chunks_per_prefix == 24
    assert plan.chunks == 24_000
    assert plan.objects == 96_000  # x 4 ranks
    assert plan.replica_records == 192_000
    assert plan.bytes_per_object == 8 * MiB  # 2 x 32 x 2 heads x 128 x 2 B x 256
    assert plan.read_bytes_per_s == 15 * GiB  # 20 x 0.75 GiB
    assert plan.nic_line_bytes_per_s == 25e9
    assert round(plan.nic_line_bytes_per_s / GiB, 2) == 23.28
    assert round(plan.nic_effective_bytes_per_s / GiB, 2) == 16.30
    assert plan.read_headroom == pytest.approx(17.5e9 / (15 * GiB))
    assert plan.write_bytes_per_s == pytest.approx(4 * GiB)  # 20 x 10% x 1 GiB x 2
    assert plan.metadata_objects_per_s == 1920  # 20 x 24 x 4
    assert plan.inflight_bytes == pytest.approx(1.5 * GiB)  # 15 GiB/s x 100 ms
    assert plan.verdict is None and plan.recompute_seconds_per_prefix is None
    # 16.30 GiB/s for 15 GiB/s of reads: the seed's "cannot carry bursts"
    assert [w for w in plan.warnings if "headroom is 1.09x" in w]
    assert len(plan.warnings) == 1


def test_seed_json_has_every_key_unrounded() -> None:
    report = seed_plan().to_json()
    keys = [
        "bytes_per_token",
        "bytes_per_prefix",
        "total_bytes",
        "replicated_bytes",
        "pool_bytes",
        "chunks_per_prefix",
        "chunks",
        "objects",
        "replica_records",
        "bytes_per_object",
        "read_bytes_per_s",
        "nic_line_bytes_per_s",
        "nic_effective_bytes_per_s",
        "read_headroom",
        "write_bytes_per_s",
        "metadata_objects_per_s",
        "inflight_bytes",
        "load_seconds_per_prefix",
        "recompute_seconds_per_prefix",
        "verdict",
        "tp_replication",
    ]
    assert set(keys) <= set(report)
    assert report["pool_bytes"] == 1500 * GiB / 0.7  # not rounded
    assert report["shape"]["kv_heads"] == 8 and report["deployment"]["tp"] == 4


def test_seed_q42_one_gib_over_200_gbit() -> None:
    assert transfer_seconds(GiB, 200) == pytest.approx(0.04295, abs=1e-5)  # ~43 ms
    # the same through a plan: an 8K prefix of the seed model is 1 GiB
    plan = make_plan(
        SEED_MODEL, workload=Workload(prefix_tokens=8192), network=Network(nic_efficiency=1.0)
    )
    assert plan.bytes_per_prefix == GiB
    assert plan.load_seconds_lower_bound == plan.load_seconds_per_prefix == GiB / 25e9


def test_seed_q42_saving_20ms_of_prefill_is_not_worth_43ms_of_transfer() -> None:
    # 2 x 6.1e8 params x 8192 tokens = 9.99e12 FLOPs at 1000 TFLOPS x 0.5 -> 19.99 ms
    shape_only = ModelShape(layers=32, kv_heads=8, head_dim=128)
    plan = make_plan(
        shape_only,
        workload=Workload(prefix_tokens=8192),
        network=Network(nic_efficiency=1.0),
        compute=Compute(gpu_tflops=1000, mfu=0.5, model_params=6.1e8),
    )
    assert plan.recompute_seconds_per_prefix == pytest.approx(2 * 6.1e8 * 8192 / 5e14)
    assert plan.recompute_seconds_per_prefix < 0.020 < plan.load_seconds_per_prefix
    assert plan.verdict == "recompute"
    assert [w for w in plan.warnings if "remote reads do not pay" in w]
    # a 70B-class model at the same rate saves seconds: load
    big = make_plan(
        shape_only,
        workload=Workload(prefix_tokens=8192),
        compute=Compute(gpu_tflops=1000, mfu=0.5, model_params=70e9),
    )
    assert big.verdict == "load"
    assert big.recompute_seconds_per_prefix == pytest.approx(2 * 70e9 * 8192 / 5e14)


def test_attention_flops_are_counted_when_heads_are_known() -> None:
    # causal attention: T(T+1)/2 query/key pairs per layer, 2 FLOPs per multiply-add
    # for QK^T (head_dim) and AV (head_dim): 2 x pairs x heads x (128 + 128)
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, attention_heads=32)
    pairs = 32 * 8192 * 8193 / 2
    assert prefill_flops(shape, 8192, 8e9) == 2 * 8e9 * 8192 + 2 * pairs * 32 * 256
    sliding = ModelShape(
        layers=4, kv_heads=1, head_dim=8, attention_heads=2, sliding_window=3, sliding_layers=2
    )
    # 2 full layers: 5 x 6 / 2 = 15 pairs each; 2 sliding (W 3): 6 + 2 x 3 = 12 pairs each
    assert prefill_flops(sliding, 5, 1.0) == 2 * 5 + 2 * (2 * 15 + 2 * 12) * 2 * 16


def test_mla_latent_is_replicated_on_every_rank() -> None:
    # DeepSeek-V3: 61 layers, latent 512 + RoPE 64, bf16, TP 8
    shape = ModelShape(layers=61, mla_latent_dim=512, mla_rope_dim=64, dtype="bf16")
    plan = make_plan(
        shape,
        Deployment(tp=8, chunk_size=256),
        Workload(prefix_tokens=4096, prefixes=100, qps=10),
        Network(nic_gbps=200, nic_efficiency=0.7),
    )
    assert plan.bytes_per_token == 70_272  # 61 x 576 x 2: one latent, not K and V
    assert plan.bytes_per_prefix == 287_834_112  # x 4096
    assert plan.tp_replication == 8  # every rank keeps the whole latent
    assert plan.stored_bytes == 230_267_289_600  # 287,834,112 x 8 x 100
    assert plan.chunks_per_prefix == 16
    assert plan.objects_per_prefix == 128  # 16 chunks x 8 ranks
    assert plan.bytes_per_object == 17_989_632  # 70,272 x 256, whole on each rank
    # reads: 10 x 2,302,672,896 B = 23.0 GB/s > 17.5 GB/s effective
    assert plan.read_bytes_per_s == 23_026_728_960
    assert plan.read_headroom is not None and plan.read_headroom < 1
    assert [w for w in plan.warnings if "the pool cannot serve every hit" in w]
    assert [n for n in plan.notes if "MLA latent is kept whole on each rank" in n]


def test_gqa_with_tp_beyond_its_kv_heads_replicates_heads() -> None:
    # Qwen2.5-7B-like: 28 layers, 4 KV heads x 128, bf16, TP 8 -> each head on 2 ranks
    shape = ModelShape(layers=28, kv_heads=4, head_dim=128, dtype="bf16")
    plan = make_plan(
        shape,
        Deployment(tp=8, chunk_size=256, replicas=3, utilization=0.8),
        Workload(prefix_tokens=8192, prefixes=500),
    )
    assert plan.bytes_per_token == 57_344  # 2 x 28 x 4 x 128 x 2
    assert plan.bytes_per_prefix == 469_762_048  # 448 MiB
    assert plan.total_bytes == 234_881_024_000  # logical
    assert plan.tp_replication == 2
    assert plan.stored_bytes == 469_762_048_000  # stored: x 2
    assert plan.replicated_bytes == 1_409_286_144_000  # x 3 replicas
    assert plan.pool_bytes == pytest.approx(1_761_607_680_000)  # / 0.8
    assert plan.bytes_per_object == 3_670_016  # one head per rank: 2 x 28 x 1 x 128 x 2 x 256
    assert plan.objects_per_prefix == 256  # 32 chunks x 8 ranks
    assert plan.objects == 128_000 and plan.replica_records == 384_000
    assert plan.objects_per_prefix * plan.bytes_per_object * 500 == plan.stored_bytes
    assert [n for n in plan.notes if "keeps each head on 2 ranks" in n]


def test_sliding_window_layers_keep_at_most_their_window() -> None:
    # Gemma-2-9B-like: 42 layers (21 sliding, W 4096), 8 KV heads x 256, bf16, TP 2, chunk 512
    shape = ModelShape(layers=42, kv_heads=8, head_dim=256, sliding_window=4096, sliding_layers=21)
    plan = make_plan(
        shape, Deployment(tp=2, chunk_size=512), Workload(prefix_tokens=8192, prefixes=100)
    )
    full, sliding = plan.groups
    # one layer, one token: 2 x 8 x 256 x 2 B = 8 KiB
    assert plan.bytes_per_token == 42 * 8 * KiB
    assert full.bytes_per_prefix == 21 * 8192 * 8 * KiB == 1_409_286_144
    assert sliding.tokens_per_prefix == 4096  # ceil(4096 / 512) = 8 chunks
    assert sliding.bytes_per_prefix == 21 * 4096 * 8 * KiB == 704_643_072
    assert plan.bytes_per_prefix == 2_113_929_216  # 1.97 GiB, not 2.63 GiB
    assert full.objects_per_prefix == 32 and sliding.objects_per_prefix == 16  # x 2 ranks
    assert plan.objects_per_prefix == 48 and plan.chunks_per_prefix == 16
    assert plan.bytes_per_object == 44_040_192  # 21 x 2 x 4 heads x 256 x 2 B x 512
    # a prefix inside the window keeps every token in both groups
    short = make_plan(shape, Deployment(tp=2, chunk_size=512), Workload(prefix_tokens=2048))
    assert short.bytes_per_prefix == 42 * 2048 * 8 * KiB


def test_pipeline_stages_split_layers_and_objects() -> None:
    # 32 layers over 3 stages: 11, 11, 10; a chunk is 2 ranks x 3 stages = 6 objects
    plan = make_plan(
        SEED_MODEL, Deployment(tp=2, pp=3, chunk_size=256), Workload(prefix_tokens=512)
    )
    assert stage_layers(32, 3) == [11, 11, 10]
    assert plan.objects_per_prefix == 2 * 6
    assert plan.bytes_per_object == 2 * 11 * 4 * 128 * 2 * 256  # the largest stage's
    assert plan.stored_bytes == plan.total_bytes  # PP moves bytes, copies none
    assert stage_layers(2, 4) == [1, 1]  # stages without layers hold no objects


def test_recurrent_state_layers_hold_one_snapshot_per_prefix() -> None:
    # 48 layers: 12 attention (2 KV heads x 256) + 36 recurrent of 1 MiB; TP 2
    shape = ModelShape(layers=48, kv_heads=2, head_dim=256, state_layers=36, state_bytes=MiB)
    plan = make_plan(shape, Deployment(tp=2), Workload(prefix_tokens=8192, prefixes=10))
    attention, state = plan.groups
    assert attention.bytes_per_prefix == 2 * 12 * 2 * 256 * 2 * 8192 == 201_326_592
    assert state.bytes_per_prefix == 36 * MiB  # whatever the prefix length
    assert state.objects_per_prefix == 2 and state.bytes_per_object == 36 * MiB // 2
    assert plan.objects_per_prefix == 32 * 2 + 2
    assert plan.bytes_per_token == 2 * 12 * 2 * 256 * 2  # state has no per-token bytes
    assert plan.total_bytes == 10 * (201_326_592 + 36 * MiB)


def test_warnings_for_block_alignment_tiny_objects_and_short_prefixes() -> None:
    odd = make_plan(SEED_MODEL, Deployment(chunk_size=200, block_size=16))
    assert [w for w in odd.warnings if "not a multiple of the engine's block size 16" in w]
    # TP 8, chunk 16: 2 x 32 x 1 head x 128 x 2 B x 16 = 256 KiB objects
    tiny = make_plan(SEED_MODEL, Deployment(tp=8, chunk_size=16))
    assert tiny.bytes_per_object == 256 * KiB
    assert [w for w in tiny.warnings if "per-object costs" in w and "--chunk-size" in w]
    short = make_plan(SEED_MODEL, workload=Workload(prefix_tokens=100))
    assert short.chunks_per_prefix == 0 and short.bytes_per_prefix == 0
    assert [w for w in short.warnings if "shorter than one chunk" in w]
    ragged = make_plan(SEED_MODEL, workload=Workload(prefix_tokens=1000))
    assert ragged.chunks_per_prefix == 3
    assert [n for n in ragged.notes if "last 232 tokens" in n]
    clean = make_plan(SEED_MODEL, Deployment(tp=4), Workload(qps=1))
    assert clean.warnings == ()


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: ModelShape(layers=32, head_dim=128), "--kv-heads is missing"),
        (lambda: ModelShape(layers=32, kv_heads=8), "--head-dim is missing"),
        (lambda: ModelShape(layers=-3, kv_heads=8, head_dim=128), "--layers must be positive"),
        (lambda: ModelShape(layers=32, kv_heads=8, head_dim=128, dtype="int4"), "--dtype"),
        (
            lambda: ModelShape(layers=32, kv_heads=8, head_dim=128, sliding_layers=4),
            "--sliding-window",
        ),
        (
            lambda: ModelShape(layers=32, kv_heads=8, head_dim=128, sliding_window=9),
            "--sliding-layers",
        ),
        (lambda: ModelShape(layers=32, kv_heads=8, head_dim=128, state_layers=2), "--state-bytes"),
        (
            lambda: ModelShape(
                layers=4,
                kv_heads=8,
                head_dim=8,
                sliding_window=9,
                sliding_layers=3,
                state_layers=2,
                state_bytes=1,
            ),
            "exceed --layers",
        ),
        (lambda: ModelShape(layers=4, kv_heads=8, mla_latent_dim=512), "--kv-heads does not apply"),
        (lambda: ModelShape(layers=4, kv_heads=8, head_dim=8, mla_rope_dim=64), "--mla-latent-dim"),
        (lambda: Deployment(utilization=0), "--utilization must be in (0, 1]"),
        (lambda: Deployment(utilization=1.5), "--utilization must be in (0, 1]"),
        (lambda: Deployment(tp=0), "--tp must be positive"),
        (lambda: Deployment(chunk_size=2.5), "--chunk-size must be a whole number"),  # type: ignore[arg-type]
        (lambda: Workload(qps=-1), "--qps must be zero or more"),
        (lambda: Workload(write_fraction=1.2), "--write-fraction must be in [0, 1]"),
        (lambda: Workload(prefixes=0), "--prefixes must be positive"),
        (lambda: Network(nic_gbps=-200), "--nic-gbps must be positive"),
        (lambda: Network(nic_efficiency=0), "--nic-efficiency"),
        (lambda: Compute(mfu=2), "--mfu"),
        (lambda: Compute(gpu_tflops=math.nan), "--gpu-tflops"),
        (lambda: make_plan(SEED_MODEL, Deployment(tp=3)), "--tp 3 does not divide"),
        (lambda: make_plan(SEED_MODEL, Deployment(tp=12)), "--tp 12 is not a multiple"),
    ],
)
def test_bad_input_names_the_flag(build: object, flag: str) -> None:
    with pytest.raises(ValueError, match=re.escape(flag)):
        build()  # type: ignore[operator]


def test_split_kv_heads() -> None:
    assert split_kv_heads(8, 4) == (2, 1)
    assert split_kv_heads(8, 8) == (1, 1)
    assert split_kv_heads(8, 16) == (1, 2)
    assert split_kv_heads(1, 8) == (1, 8)  # MQA: every rank keeps the one head
