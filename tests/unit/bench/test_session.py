"""What ``kvtier bench`` decides before it starts anything: the trace, the
working set, and refusals of bad flags (exit 2, naming the flag)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.command import replay_spec, resolve, trace_options
from kvtier.bench.session import BenchRequest, build_trace, working_set_chunks
from kvtier.commands.cli import build_parser, main
from kvtier.traces import TraceRequest, write_trace
from tests.unit.traces.conversations import conversation_rows, write_rows


def test_working_set_counts_chunks_as_prefixes() -> None:
    a = tuple(range(8))
    trace = [
        TraceRequest("1", 0, (*a, 9), 1),  # chunks (0-3), (4-7)
        TraceRequest("2", 0, a, 1),  # the same two
        TraceRequest("3", 0, a[4:] + a[:4], 1),  # same tokens, other order: two new ones
        TraceRequest("4", 0, (*a[:4], 7, 7, 7, 7), 1),  # first shared, second new
    ]
    assert working_set_chunks(trace, chunk=4) == 5


def test_build_trace_from_options_and_files(tmp_path: Path) -> None:
    rag, described = build_trace(BenchRequest(trace_options={"requests": 7, "documents": 3}))
    assert described.startswith("RAG (") and sum(not r.warm for r in rag) == 7
    chat, described = build_trace(
        BenchRequest(workload="chat", trace_options={"sessions": 2, "requests": 99})
    )
    assert described.startswith("chat (") and {r.id.split("-")[1] for r in chat} == {"000", "001"}
    path = tmp_path / "t.jsonl"
    write_trace(path, rag)
    again, described = build_trace(BenchRequest(trace_path=path))
    assert again == rag and described == f"file {path}"


def test_a_mooncake_trace_is_replayed_as_its_options_say(tmp_path: Path) -> None:
    rows = conversation_rows(50)
    path = write_rows(tmp_path / "m.jsonl", [*rows[:10], "{", *rows[10:]])
    options = resolve(
        build_parser().parse_args(
            ["bench", "--trace", str(path), "--trace-block-tokens", "16", "--skip-bad-lines"]
        )
    )
    trace, described = build_trace(BenchRequest(trace_path=path, replay=replay_spec(options)))
    assert len(trace) == 50 and "1 bad lines skipped" in described
    assert max(max(r.prompt) for r in trace) < 4096  # the bench model's vocabulary
    assert max(r.output_tokens for r in trace) <= 48
    first = rows[0]
    assert len(trace[0].prompt) == -(-first["input_length"] * 16 // 512)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--configs", "apc,fast"], "--configs: unknown ['fast']"),
        (["--kill-at", "0.7", "--restart-at", "0.2"], "--kill-at and --restart-at"),
        (["--scenario", "/nonexistent.toml"], "--scenario /nonexistent.toml"),
        (["--slo-ttft-s", "0"], "--slo-ttft-s"),
        (["--l1-size", "lots"], "--l1-size"),
        (["--quick", "--requests", "0"], "--requests must be at least 1"),
    ],
)
def test_bad_flags_exit_2(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


SCENARIOS = sorted(Path(__file__).parents[3].joinpath("benchmarks", "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_scenario_files_build_their_traces(path: Path) -> None:
    options = resolve(build_parser().parse_args(["bench", "--scenario", str(path)]))
    request = BenchRequest(workload=options.workload, trace_options=trace_options(options))
    trace, described = build_trace(request)
    assert described.startswith(options.workload.replace("rag", "RAG"))
    assert sum(not r.warm for r in trace) > 0


def test_flags_win_over_the_scenario_which_wins_over_quick(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text('rate = 3.0\ndoc-tokens = "100:200"\nl1_size_bytes = "2GiB"\n')
    parse = build_parser().parse_args
    options = resolve(parse(["bench", "--quick", "--scenario", str(scenario), "--rate", "5"]))
    assert options.rate == 5.0  # the flag
    assert options.doc_tokens == (100, 200) and options.l1_size_bytes == 2 << 30  # the scenario
    assert options.requests == 20  # --quick
    assert options.configs == "apc,apc+l1,apc+l1+remote,lmcache"  # the default
    scenario.write_text("speed = 3\n")
    with pytest.raises(ValueError, match="unknown option speed in --scenario"):
        resolve(parse(["bench", "--scenario", str(scenario)]))
