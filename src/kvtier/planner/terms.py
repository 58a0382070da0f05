"""The terms of a plan: what it is asked (a ``Deployment``, a ``Workload``, a
``Network``, a ``Compute``) and what it answers (a ``Plan`` of ``GroupPlan``s),
each a frozen dataclass that checks its own fields. ``make_plan``
(``kvtier.planner.plan``) does the arithmetic; ``kvtier.planner.checks`` puts
what a plan should tell its reader into words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.planner.shape import ModelShape, require_fraction, require_int, require_positive
from kvtier.read_or_recompute import Verdict

BYTES_PER_GBIT = 1e9 / 8


@dataclass(frozen=True, slots=True)
class Deployment:
    """How the model is served and the pool kept."""

    tp: int = 1
    pp: int = 1
    chunk_size: int = 256
    block_size: int = 16  # the engine's KV block (page) in tokens
    replicas: int = 1  # copies of every object in the pool
    utilization: float = 0.7  # the share of the physical pool data may occupy

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tp", self.tp),
            ("--pp", self.pp),
            ("--chunk-size", self.chunk_size),
            ("--block-size", self.block_size),
            ("--replicas", self.replicas),
        ):
            require_int(flag, value)
        require_fraction("--utilization", self.utilization)


@dataclass(frozen=True, slots=True)
class Workload:
    """The prefixes kept and the traffic that reads and writes them."""

    prefix_tokens: int = 8192
    prefixes: int = 1000
    qps: float = 1.0
    write_fraction: float = 0.0  # requests that write a new prefix
    write_tokens: int | None = None  # tokens of a new prefix (None: prefix_tokens)
    read_fraction: float = 1.0  # of each request's prefix, the share read from the pool

    def __post_init__(self) -> None:
        require_int("--prefix-tokens", self.prefix_tokens)
        require_int("--prefixes", self.prefixes)
        require_int("--write-tokens", self.write_tokens)
        require_positive("--qps", self.qps, allow_zero=True)
        require_fraction("--write-fraction", self.write_fraction, allow_zero=True)
        require_fraction("--read-fraction", self.read_fraction, allow_zero=True)

    @property
    def new_prefix_tokens(self) -> int:
        return self.prefix_tokens if self.write_tokens is None else self.write_tokens


@dataclass(frozen=True, slots=True)
class Network:
    """The NIC that carries pool reads and writes, and how long data stays staged."""

    nic_gbps: float = 200.0
    nic_efficiency: float = 0.7  # the share of line rate a transfer really gets
    staging_ms: float = 100.0  # average time a read's bytes occupy staging memory

    def __post_init__(self) -> None:
        require_positive("--nic-gbps", self.nic_gbps)
        require_fraction("--nic-efficiency", self.nic_efficiency)
        require_positive("--staging-ms", self.staging_ms, allow_zero=True)

    @property
    def line_bytes_per_s(self) -> float:
        return self.nic_gbps * BYTES_PER_GBIT

    @property
    def effective_bytes_per_s(self) -> float:
        return self.line_bytes_per_s * self.nic_efficiency


@dataclass(frozen=True, slots=True)
class Compute:
    """The accelerator a recompute runs on (per TP rank)."""

    gpu_tflops: float | None = None  # dense peak of the KV dtype, per GPU
    mfu: float = 0.4  # the share of that peak a prefill reaches
    model_params: float | None = None  # parameters active per token (MoE: active only)

    def __post_init__(self) -> None:
        require_positive("--gpu-tflops", self.gpu_tflops)
        require_fraction("--mfu", self.mfu)
        require_positive("--model-params", self.model_params)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One object group of one cached prefix."""

    name: str
    layers: int
    tp_replication: int  # copies of each byte across TP ranks
    tokens_per_prefix: int  # tokens stored per prefix (0 for a recurrent state)
    bytes_per_token: int  # logical: the whole model once
    bytes_per_prefix: int  # logical
    stored_bytes_per_prefix: int  # over all ranks, TP replicas included
    objects_per_prefix: int
    bytes_per_object: int  # the largest rank's object


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything ``kvtier plan`` reports; ``to_json()`` for the ``--json`` form."""

    shape: ModelShape
    deployment: Deployment
    workload: Workload
    network: Network
    compute: Compute
    groups: tuple[GroupPlan, ...]
    # capacity
    bytes_per_token: int
    bytes_per_prefix: int
    total_bytes: int
    tp_replication: int
    stored_bytes: int
    replicated_bytes: int
    pool_bytes: float
    chunks_per_prefix: int
    chunks: int
    objects_per_prefix: int
    objects: int
    replica_records: int
    bytes_per_object: int
    # bandwidth
    read_bytes_per_s: float
    write_bytes_per_s: float
    nic_line_bytes_per_s: float
    nic_effective_bytes_per_s: float
    read_headroom: float | None  # None: nothing is read
    metadata_objects_per_s: float
    inflight_bytes: float
    # read or recompute
    load_seconds_lower_bound: float
    load_seconds_per_prefix: float
    recompute_seconds_per_prefix: float | None
    verdict: Verdict | None
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
