"""Trace generators and trace files: reproducible, shaped as specified, and
bad files refused naming the line."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from kvtier.traces import (
    ChatSpec,
    RagSpec,
    chat_trace,
    rag_trace,
    read_trace,
    write_trace,
)

SMALL = RagSpec(requests=200, rate=2.0, documents=8, doc_tokens=(40, 60), system_tokens=16)


def test_rag_is_reproducible_and_seeded() -> None:
    assert rag_trace(SMALL) == rag_trace(SMALL)
    other = rag_trace(RagSpec(**{**_fields(SMALL), "seed": 1}))
    assert [r.prompt for r in other] != [r.prompt for r in rag_trace(SMALL)]


def _fields(spec: RagSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def test_rag_shape() -> None:
    trace = rag_trace(SMALL)
    primers = [r for r in trace if r.warm]
    measured = [r for r in trace if not r.warm]
    assert len(primers) == SMALL.documents and len(measured) == SMALL.requests
    system = primers[0].prompt[: SMALL.system_tokens]
    documents = [p.prompt[SMALL.system_tokens :] for p in primers]
    assert all(p.prompt[: SMALL.system_tokens] == system and p.output_tokens == 1 for p in primers)
    assert all(40 <= len(d) <= 60 for d in documents)
    uses: Counter[int] = Counter()
    for request in measured:
        docs = [int(d) for d in request.label.removeprefix("docs ").split("+")]
        assert 1 <= len(docs) <= 3 and len(set(docs)) == len(docs)
        body = system + tuple(t for d in docs for t in documents[d])
        assert request.prompt[: len(body)] == body  # system, documents, then the question
        assert 24 <= len(request.prompt) - len(body) <= 64
        assert 16 <= request.output_tokens <= 48
        uses.update(docs)
    assert uses.most_common(1)[0][0] == 0  # Zipf: the first document is the most popular
    arrivals = [r.arrival_s for r in measured]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    mean_gap = arrivals[-1] / len(arrivals)
    assert 0.35 < mean_gap < 0.65  # Poisson at 2 per second: 0.5 s on average


def test_rag_prompts_do_not_depend_on_rate_or_output_lengths() -> None:
    slow = rag_trace(RagSpec(**{**_fields(SMALL), "rate": 0.1, "output_tokens": (1, 2)}))
    assert [r.prompt for r in slow] == [r.prompt for r in rag_trace(SMALL)]
    assert all(r.arrival_s == 0 for r in rag_trace(RagSpec(**{**_fields(SMALL), "rate": 0})))


def test_chat_turns_grow_from_the_previous_prompt() -> None:
    spec = ChatSpec(sessions=4, turns=(2, 5), think_s=1.0, system_tokens=8, user_tokens=(4, 9))
    trace = chat_trace(spec)
    sessions: dict[str, list[tuple[int, ...]]] = {}
    for request in sorted(trace, key=lambda r: r.id):
        sessions.setdefault(request.id.split("-")[1], []).append(request.prompt)
    assert len(sessions) == 4
    for prompts in sessions.values():
        assert 2 <= len(prompts) <= 5
        for earlier, later in itertools.pairwise(prompts):
            assert later[: len(earlier)] == earlier and len(later) > len(earlier)
    by_session: dict[str, float] = {}
    for request in sorted(trace, key=lambda r: r.id):  # a session's turns come in order
        session = request.id.split("-")[1]
        assert request.arrival_s >= by_session.get(session, 0.0)
        by_session[session] = request.arrival_s
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_file_round_trip(tmp_path: Path) -> None:
    trace = rag_trace(RagSpec(requests=5, documents=3, doc_tokens=(10, 20)))
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    assert json.loads(path.read_text().splitlines()[0])["warm"] is True


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "a", "arrival_s": 0, "prompt": [1], "output_tokens": 1}', "{oops"], ":2: not a"),
        (['{"id": "a", "arrival_s": 0, "prompt": [], "output_tokens": 1}'], ":1: a request needs"),
        (
            ['{"id": "a", "arrival_s": -1, "prompt": [1], "output_tokens": 1}'],
            ":1: a request needs",
        ),
        (['{"id": "a", "prompt": [1], "output_tokens": 1}'], ":1: not a trace request"),
        (
            ['{"id": "a", "arrival_s": 0, "prompt": [1], "output_tokens": 1}'] * 2,
            "ids must be unique",
        ),
        (
            ['{"id": "a", "arrival_s": 0, "prompt": [1], "output_tokens": 1, "warm": true}'],
            "no (measured) requests",
        ),
    ],
)
def test_bad_files_name_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="--trace") as info:
        read_trace(path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: RagSpec(requests=0), "--requests"),
        (lambda: RagSpec(doc_tokens=(10, 5)), "--doc-tokens"),
        (lambda: RagSpec(rate=-1), "--rate"),
        (lambda: ChatSpec(turns=(0, 2)), "--turns"),
        (lambda: ChatSpec(think_s=-1), "--think-s"),
    ],
)
def test_bad_specs_name_the_flag(build: object, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        build()  # type: ignore[operator]
