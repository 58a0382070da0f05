"""``kvtier blend-eval``'s parts that need no model: the retrieval task, the
summaries (exact numbers from hand-made rows), the tables and the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from kvtier.bench.blend.evaluation import (
    BlendEvalRequest,
    Measured,
    _rows_to_resume,
    configurations,
    interval,
    latency,
    latency_spec,
    margin,
    spelling,
    summarize,
)
from kvtier.bench.blend.report import answers_table, latency_table, quality_plot, quality_table
from kvtier.bench.retrieval import RetrievalSpec, document_pool, retrieval_prompts


def test_the_task_is_pure_and_each_question_has_its_document() -> None:
    spec = RetrievalSpec(prompts=30, pool=12, documents=(2, 5), seed=3)
    pool = document_pool(spec)
    assert document_pool(spec) == pool and retrieval_prompts(spec) == retrieval_prompts(spec)
    assert len({d.name for d in pool}) == len({d.code for d in pool}) == 12
    for prompt in retrieval_prompts(spec, pool):
        assert 2 <= len(prompt.documents) <= 5 and len(set(prompt.documents)) == len(
            prompt.documents
        )
        assert prompt.asked in prompt.documents
        document = pool[prompt.asked]
        assert prompt.answer == document.code and f"is {document.code}." in document.text
        assert pool[prompt.asked].name in prompt.parts[-1]
        assert len(prompt.parts) == len(prompt.documents) + 2
        assert prompt.correct(f"The access code is {document.code}.")
        assert not prompt.correct("I do not know.")
        assert prompt.codes == tuple(pool[d].code for d in prompt.documents)
        assert prompt.answered(f"It is {document.code}.") == "asked"
        assert prompt.answered("I do not know.") == "none"
        others = [pool[d].code for d in prompt.documents if d != prompt.asked]
        assert prompt.answered(f"It is {others[0]}.") == "another"
        assert prompt.answered(f"{others[0]} or {document.code}") == "asked"
    words = [len(d.text.split()) for d in pool]
    assert min(words) >= spec.words[0] and max(words) <= spec.words[1] + 40


def test_the_code_sentence_opens_the_document_unless_asked_anywhere() -> None:
    first = document_pool(RetrievalSpec(pool=12))
    anywhere = document_pool(RetrievalSpec(pool=12, code_first=False))
    inside = 0
    for a, b in zip(first, anywhere, strict=True):
        title = f"Document about {a.name}.\n"
        sentence = f"The access code of {a.name} is {a.code}."
        assert a.text.startswith(f"{title}{sentence} ") and sentence in b.text
        assert sorted(a.text.split()) == sorted(b.text.split())  # the same words otherwise
        inside += not b.text.startswith(f"{title}{sentence}")
    assert inside >= 6  # anywhere: mostly not first
    timed = latency_spec(RetrievalSpec(code_first=False), 3)
    assert not timed.code_first and timed.documents == (4, 4)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="pool"):
        RetrievalSpec(pool=3, documents=(2, 6))
    with pytest.raises(ValueError, match="range"):
        RetrievalSpec(documents=(4, 2))


def measured(correct: bool, agreement: float = 1.0, ttft: float = 1.0) -> dict[str, Any]:
    answered = "asked" if correct else "another"
    return asdict(Measured(ttft, work=0.25, agreement=agreement, kl=0.5 * (1 - agreement),
                           equal=agreement == 1.0, correct=correct, answered=answered))  # fmt: skip


NAMES = list(configurations((0.0, 0.15), ()))


def rows() -> list[dict[str, Any]]:
    """Four prompts: full prefill right on three (margins 0.9, 0.1, 0.5);
    'blend 0.15' keeps two of them, the surer ones."""
    out = []
    cases = [(True, True, 0.9), (True, False, 0.1), (True, True, 0.5), (False, True, 0.2)]
    for i, (full_ok, blend_ok, lead) in enumerate(cases):
        row = {"tokens": 100 + i, "margin": lead, "full": measured(full_ok, ttft=4.0 + i)}
        row["prefix-only"] = measured(full_ok, ttft=3.0)
        row["blend 0"] = measured(False, agreement=0.5, ttft=0.5)
        row["blend 0.15"] = measured(blend_ok, agreement=0.75 if not blend_ok else 1.0, ttft=1.0)
        row["bottom-right 0.15"] = measured(blend_ok, ttft=1.1)
        row["impact 0.15"] = measured(blend_ok, agreement=0.95, ttft=1.0)
        row["CacheBlend 0.15"] = measured(False, agreement=0.75, ttft=1.0)
        row["deviation 0.15"] = measured(blend_ok, agreement=0.9, ttft=1.0)
        out.append(row)
    return out


def test_summaries_and_retention() -> None:
    summary = summarize(rows(), NAMES)
    assert summary["full_prefill_correct"] == 3 and summary["full_prefill_accuracy"] == 0.75
    blend = summary["blend 0.15"]
    assert blend["retention"] == round(2 / 3, 3) and blend["accuracy"] == 0.75
    assert blend["top1_agreement"] == round((1 + 0.75 + 1 + 1) / 4, 4)
    assert blend["greedy_equal"] == 0.75 and blend["segments_all_found"] == 1.0
    assert summary["blend 0"]["retention"] == 0.0
    assert summary["full"]["ttft_p50_s"] == 5.5
    assert summary["full_prefill_margin"] == {
        "median": 0.5, "range": [0.1, 0.9], "surer_half": 2, "less_sure_half": 1
    }  # fmt: skip
    assert summary["full_prefill_another_code"] == 1
    assert blend["retention_surer_half"] == 1.0 and blend["retention_less_sure_half"] == 0.0
    assert blend["lost_to_another_code"] == 1 and summary["blend 0"]["lost_to_another_code"] == 3


def test_rows_without_margins_are_in_neither_half() -> None:
    old = [{k: v for k, v in row.items() if k != "margin"} for row in rows()]
    summary = summarize(old, NAMES)
    assert summary["full_prefill_correct"] == 3
    assert summary["full_prefill_margin"]["median"] is None
    assert summary["blend 0.15"]["retention_surer_half"] is None


def test_bootstrap_intervals_hold_the_mean_and_repeat() -> None:
    values = [1.0] * 30 + [0.0] * 10
    low, high = interval(values) or (0.0, 0.0)
    assert 0.55 < low < 0.75 < high < 0.9
    assert interval(values) == [low, high] and interval([0.5, 0.5]) == [0.5, 0.5]
    assert interval([]) is None
    summary = summarize(rows(), NAMES)["blend 0.15"]
    assert summary["retention_ci95"] == interval([1.0, 0.0, 1.0])


def test_margin_is_the_least_lead_of_the_chosen_token() -> None:
    probabilities = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.45, 0.05]])
    assert margin(probabilities.log()) == pytest.approx(0.05)


PIECES = ("The", " code", " is", " MAR", "LIN", "-", "42", ".")


class Pieces:
    """A tokenizer whose token i decodes to PIECES[i]."""

    def decode(self, tokens: list[int]) -> str:
        return "".join(PIECES[t] for t in tokens)


def test_the_tokens_that_spell_the_code() -> None:
    tokens = list(range(len(PIECES)))
    assert spelling(Pieces(), tokens, "MARLIN-42") == [3, 4, 5, 6]
    assert spelling(Pieces(), tokens, "LIN-4") == [4, 5, 6]  # a token partly inside counts
    assert spelling(Pieces(), tokens, "OTTER-17") is None


def test_latency_ratios() -> None:
    timed = [{"tokens": 2000 + i, "full_ttft_s": 6.0, "prefix-only": 5.0, "blend 0.15": 2.0,
              "blend 0": 0.5} for i in range(3)]  # fmt: skip
    out = latency(timed, NAMES)
    assert out["blend 0.15"] == {
        "ttft_p50_s": 2.0, "speedup_vs_full": 3.0, "speedup_vs_prefix_only": 2.5
    }  # fmt: skip
    assert out["prompt_tokens_range"] == [2000, 2002] and "bottom-right 0.15" not in out


def test_tables_and_plot(tmp_path: Path) -> None:
    names = configurations((0.0, 0.15, 1.0), (0.15,))
    table_rows = []
    for row in rows():
        row["blend 1"] = measured(row["full"]["correct"])
        row["static 0.15"] = measured(True, agreement=0.9)
        table_rows.append(row)
    results = {
        "configurations": {n: asdict(c) for n, c in names.items()},
        "quality": summarize(table_rows, list(names)),
        "latency": latency(
            [{"tokens": 2000, "full_ttft_s": 6.0, "prefix-only": 5.0, "blend 0.15": 2.0}],
            list(names),
        ),
    }
    console = Console(record=True, width=160)
    console.print(quality_table(results))
    console.print(answers_table(results))
    console.print(latency_table(results))
    text = console.export_text()
    assert "static 0.15" in text and "CacheBlend 0.15" in text
    assert "3.00x" in text and "2.50x" in text
    assert "margins 0.10-0.90, median 0.50" in text and "1 of 3" in text
    assert "0.667 │ 0.00-1.00" in text  # blend 0.15's retention and its interval
    plot = tmp_path / "quality.png"
    quality_plot(results, plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_a_resumed_run_keeps_rows_of_the_same_configurations_only(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    names = configurations((0.0, 0.15), ())
    assert _rows_to_resume(path, names) == []  # nothing measured yet
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    assert _rows_to_resume(path, names) == rows()
    with pytest.raises(ValueError, match=r"row 1 has no blend 0\.3.*--ratios"):
        _rows_to_resume(path, configurations((0.0, 0.15, 0.3), ()))


def test_the_blends_compared_are_chosen_by_name() -> None:
    names = configurations((0.0, 0.15), (0.15,), ("impact",))
    assert list(names) == ["blend 0", "blend 0.15", "impact 0.15", "static 0.15"]
    assert names["blend 0.15"].selection == "question"  # kvtier's default
    assert names["impact 0.15"].selection == "impact"
    with pytest.raises(ValueError, match=r"--compare: unknown \['bogus'\]"):
        BlendEvalRequest(compare=("impact", "bogus"))


def test_empty_lists_mean_none_and_nothing_at_all_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvtier.commands.cli import main

    assert list(configurations((0.5,), (), ())) == ["blend 0.5"]
    out = tmp_path / "out"
    assert main(["blend-eval", "--ratios", "", "--static", "", "--compare", "", "--out", str(out)])
    assert "no blend to measure: give --ratios, --static or --compare" in capsys.readouterr().err
    assert not out.exists()  # refused before any work
