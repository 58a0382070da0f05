"""``kvtier blend-eval``'s parts that need no model: the retrieval task, the
summaries (exact numbers from hand-made rows), the tables and the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvtier.bench.blend_eval import (
    Measured,
    _rows_to_resume,
    configurations,
    latency,
    summarize,
)
from kvtier.bench.blend_report import latency_table, quality_plot, quality_table
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
    words = [len(d.text.split()) for d in pool]
    assert min(words) >= spec.words[0] and max(words) <= spec.words[1] + 40


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="pool"):
        RetrievalSpec(pool=3, documents=(2, 6))
    with pytest.raises(ValueError, match="range"):
        RetrievalSpec(documents=(4, 2))


def measured(correct: bool, agreement: float = 1.0, ttft: float = 1.0) -> dict[str, Any]:
    return asdict(Measured(ttft, work=0.25, agreement=agreement, kl=0.5 * (1 - agreement),
                           equal=agreement == 1.0, correct=correct))  # fmt: skip


NAMES = list(configurations((0.0, 0.15), ()))


def rows() -> list[dict[str, Any]]:
    """Four prompts: full prefill right on three; 'blend 0.15' keeps two of them."""
    out = []
    for i, (full_ok, blend_ok) in enumerate([(True, True), (True, False), (True, True),
                                              (False, True)]):  # fmt: skip
        row = {"tokens": 100 + i, "full": measured(full_ok, ttft=4.0 + i)}
        row["prefix-only"] = measured(full_ok, ttft=3.0)
        row["blend 0"] = measured(False, agreement=0.5, ttft=0.5)
        row["blend 0.15"] = measured(blend_ok, agreement=0.75 if not blend_ok else 1.0, ttft=1.0)
        row["bottom-right 0.15"] = measured(blend_ok, ttft=1.1)
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
    console.print(latency_table(results))
    text = console.export_text()
    assert "static 0.15" in text and "CacheBlend 0.15" in text
    assert "3.00x" in text and "2.50x" in text
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
