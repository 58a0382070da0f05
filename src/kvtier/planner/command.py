"""``kvtier plan``: its flags, and how they combine with ``--model-config`` and
``--from-server`` (flags win over the server, the server over the config)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import secret
from kvtier.output import JSON_HELP, report_stream, write_json
from kvtier.planner.handoff import Handoff, plan_handoff
from kvtier.planner.hf_config import read_shape_fields
from kvtier.planner.observed import Observation, observe
from kvtier.planner.plan import Compute, Deployment, Network, Workload, make_plan
from kvtier.planner.report import format_plan
from kvtier.planner.shape import DTYPES, ModelShape
from kvtier.planner.trace_plan import (
    DEFAULT_TARGETS,
    TraceQuestion,
    format_trace_plan,
    plan_trace,
    plot_trace_plan,
)
from kvtier.traces.lines import DEFAULT_MAX_LINE_BYTES, MAX_LINE_FLAG
from kvtier.units import parse_size

_COUNT_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _parameter_count(text: str) -> float:
    """``8e9``, ``8B``, ``671B``, ``37.5b``."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 8B or 8e9, got {text!r}")
    return float(match[1]) * _COUNT_SUFFIXES[match[2].lower()]


def _state_bytes(text: str) -> int:
    try:
        return parse_size(text, "--state-bytes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _max_line_bytes(text: str) -> int:
    try:
        return parse_size(text, MAX_LINE_FLAG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Flag:
    name: str  # its dest is the input's field of the same name
    type: Callable[[str], Any]
    help: str

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


# Each input's flags, under their help heading. A flag left out (None) keeps
# the value from the server, the config or the dataclass default.
_INPUTS: dict[str, tuple[str, tuple[_Flag, ...]]] = {
    "shape": (
        "model shape",
        (
            _Flag("--layers", int, "all layers"),
            _Flag("--kv-heads", int, "KV heads (GQA/MQA), all ranks together"),
            _Flag("--head-dim", int, "size of one attention head"),
            _Flag("--dtype", str, f"KV dtype: {', '.join(DTYPES)} (default bf16)"),
            _Flag("--mla-latent-dim", int, "MLA: the latent per token per layer"),
            _Flag("--mla-rope-dim", int, "MLA: its decoupled RoPE part"),
            _Flag("--sliding-window", int, "window of the sliding layers, tokens"),
            _Flag("--sliding-layers", int, "layers with the window (default: every attention one)"),
            _Flag("--state-layers", int, "layers holding a recurrent state"),
            _Flag("--state-bytes", _state_bytes, "one such layer's state, e.g. 2MiB"),
            _Flag("--attention-heads", int, "query heads (adds attention FLOPs to a recompute)"),
        ),
    ),
    "deployment": (
        "parallelism and pool",
        (
            _Flag("--tp", int, "tensor parallel ranks (1)"),
            _Flag("--pp", int, "pipeline stages (1)"),
            _Flag("--chunk-size", int, "tokens per chunk (256)"),
            _Flag("--block-size", int, "the engine's KV block in tokens (16)"),
            _Flag("--replicas", int, "copies of every object (1)"),
            _Flag("--utilization", float, "share of the pool data may fill (0.7)"),
        ),
    ),
    "workload": (
        "workload",
        (
            _Flag("--prefix-tokens", int, "tokens of a shared prefix (8192)"),
            _Flag("--prefixes", int, "distinct prefixes kept (1000)"),
            _Flag("--qps", float, "requests per second (1)"),
            _Flag("--read-fraction", float, "share of a prefix read from the pool (1)"),
            _Flag("--write-fraction", float, "requests writing a new prefix (0)"),
            _Flag("--write-tokens", int, "tokens of a new prefix (--prefix-tokens)"),
        ),
    ),
    "network": (
        "network",
        (
            _Flag("--nic-gbps", float, "NIC line rate in Gbit/s (200)"),
            _Flag("--nic-efficiency", float, "share of line rate reached (0.7)"),
            _Flag("--staging-ms", float, "time a read stays in staging (100)"),
        ),
    ),
    "handoff": (
        "prefill/decode hand-off (reported apart from reuse when --pd-qps is given)",
        (
            _Flag("--pd-qps", float, "requests per second handed from prefill to decode"),
            _Flag("--pd-prompt-tokens", int, "tokens of a handed-off prompt (8192)"),
            _Flag("--pd-output-tokens", int, "tokens the decode side generates (256)"),
            _Flag("--pd-itl-ms", float, "the decode side's time per output token (30)"),
            _Flag("--decode-tp", int, "the decode side's TP (--tp)"),
            _Flag("--handoff-wait-ms", float, "from the commit to the decode's load (50)"),
            _Flag("--handoff-lease-s", float, "an unconsumed hand-off lives this long (30)"),
        ),
    ),
    "compute": (
        "read or recompute",
        (
            _Flag("--gpu-tflops", float, "dense TFLOPS of one GPU in the KV dtype"),
            _Flag("--mfu", float, "share of that a prefill reaches (0.4)"),
            _Flag("--model-params", _parameter_count, "parameters active per token, e.g. 8B"),
        ),
    ),
}


def add_parser(commands: Any) -> None:
    """Add ``plan`` to the ``kvtier`` subcommands."""
    plan = commands.add_parser(
        "plan",
        help="capacity, bandwidth and read-or-recompute for a model and workload",
        description="Capacity, bandwidth and read-or-recompute arithmetic (docs/planning.md). "
        "Flags win over --from-server, which wins over --model-config.",
    )
    src = plan.add_argument_group("where the model shape comes from")
    src.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    src.add_argument(
        "--from-server",
        metavar="URL",
        help="a cache server's admin HTTP, e.g. http://127.0.0.1:8765",
    )
    src.add_argument(
        "--auth-token-file",
        help="a file holding the server's admin token (else KVTIER_AUTH_TOKEN)",
    )
    src.add_argument(
        "--sample-s",
        type=float,
        default=10.0,
        help="seconds between two /metrics readings (0: averages since the server started)",
    )
    src.add_argument("--namespace", help="model@salt to plan when the server has several")
    for title, flags in _INPUTS.values():
        group = plan.add_argument_group(title)
        for flag in flags:
            choices = list(DTYPES) if flag.name == "--dtype" else None
            group.add_argument(flag.name, type=flag.type, choices=choices, help=flag.help)
    _add_trace_flags(plan.add_argument_group("a real trace (docs/planning.md)"))
    plan.add_argument("--json", metavar="FILE", help=JSON_HELP)
    plan.set_defaults(run=run)


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list, got {text!r}"
            ) from None

    return parse


def _add_trace_flags(group: Any) -> None:
    group.add_argument("--trace", metavar="FILE", help="a Mooncake-format trace (JSONL)")
    group.add_argument(
        "--capacities",
        type=_numbers(int),
        metavar="T1,T2,...",
        help="cache capacities in tokens to report (default: 6 from 64 blocks to the working set)",
    )
    group.add_argument(
        "--policies",
        type=_numbers(str),
        default=("gdsf", "probation"),
        metavar="P1,...",
        help="kvtier eviction policies simulated beside the exact LRU curve and the offline "
        "optimum (gdsf,probation; '' none)",
    )
    group.add_argument(
        "--targets",
        type=_numbers(float),
        default=DEFAULT_TARGETS,
        metavar="S1,...",
        help="shares of the reuse ceiling to size the cache for (0.5,0.8,0.9,0.95,0.99)",
    )
    group.add_argument("--l1-tokens", type=int, help="L1 capacity in tokens: the tier split")
    group.add_argument("--l2-tokens", type=int, help="L2 capacity in tokens (with --l1-tokens)")
    group.add_argument(
        "--prefill-rate", type=float, metavar="TOKENS_PER_S", help="prefill rate: seconds saved"
    )
    group.add_argument("--plot", metavar="FILE", help="the reuse curve as a PNG")
    group.add_argument(
        "--skip-bad-lines", action="store_true", help="leave bad trace lines out, counted"
    )
    group.add_argument(
        MAX_LINE_FLAG,
        dest="max_line_bytes",
        type=_max_line_bytes,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="SIZE",
        help="a longer trace line is a bad line, never held whole (1MiB)",
    )


def _given(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The flags of input ``kind`` that were given, by field."""
    values = {flag.dest: getattr(args, flag.dest) for flag in _INPUTS[kind][1]}
    return {name: value for name, value in values.items() if value is not None}


def _shape(args: argparse.Namespace, observed: Observation | None) -> ModelShape:
    fields: dict[str, Any] = {}
    if args.model_config:
        fields.update(read_shape_fields(args.model_config))
    if observed is not None:
        fields.update(observed.shape_fields())
    flags = _given(args, "shape")
    if "mla_latent_dim" in flags:  # an MLA model from flags has no KV heads
        fields.pop("kv_heads", None)
    fields.update(flags)
    if "layers" not in fields:
        raise ValueError("--layers is missing: pass the model's shape or --model-config PATH")
    if fields.get("sliding_window") is not None and not fields.get("sliding_layers"):
        fields["sliding_layers"] = fields["layers"] - fields.get("state_layers", 0)
    return ModelShape(**fields)


def _has_shape(args: argparse.Namespace) -> bool:
    return bool(args.model_config or args.from_server or _given(args, "shape"))


def run_trace(args: argparse.Namespace, observed: Observation | None) -> int:
    bytes_per_token = None
    if _has_shape(args):
        deployment = Deployment(**_given(args, "deployment"))
        bytes_per_token = make_plan(_shape(args, observed), deployment).bytes_per_token
    question = TraceQuestion(
        capacities_tokens=args.capacities or (),
        policies=args.policies,
        targets=args.targets,
        l1_tokens=args.l1_tokens,
        l2_tokens=args.l2_tokens,
        prefill_tokens_per_s=args.prefill_rate,
        bytes_per_token=bytes_per_token,
        skip_bad_lines=args.skip_bad_lines,
        max_line_bytes=args.max_line_bytes,
    )
    plan = plan_trace(Path(args.trace), question)
    print(format_trace_plan(plan), file=report_stream(args.json))
    if args.plot:
        plot_trace_plan(plan, Path(args.plot))
    if args.json:
        write_json(args.json, plan.to_json())
    return 0


def run(args: argparse.Namespace) -> int:
    observed = None
    if args.from_server:
        token = secret(args.auth_token_file, "--auth-token-file", "KVTIER_AUTH_TOKEN")
        observed = observe(args.from_server, token, args.sample_s, args.namespace)
    if args.trace:
        return run_trace(args, observed)
    deployment = observed.deployment_fields() if observed else {}
    workload = observed.workload_fields() if observed else {}
    plan = make_plan(
        _shape(args, observed),
        Deployment(**{**deployment, **_given(args, "deployment")}),
        Workload(**{**workload, **_given(args, "workload")}),
        Network(**_given(args, "network")),
        Compute(**_given(args, "compute")),
    )
    pd = _given(args, "handoff")
    if pd and "pd_qps" not in pd:
        raise ValueError(f"--{next(iter(pd)).replace('_', '-')} needs --pd-qps (the hand-off rate)")
    handoff = plan_handoff(plan.shape, plan.deployment, plan.network, Handoff(**pd)) if pd else None
    print(format_plan(plan, observed, handoff), file=report_stream(args.json))
    if args.json:
        report = plan.to_json()
        if handoff is not None:
            report["handoff"] = handoff.to_json()
        if observed is not None:
            report["observed"] = {**dataclasses.asdict(observed), **observed.workload_fields()}
        write_json(args.json, report)
    return 0


__all__ = ["add_parser", "run"]
