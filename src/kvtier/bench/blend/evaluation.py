"""``kvtier blend-eval``: the quality and latency of blended prefills, measured
on a real model against full prefill, in one run.

The model is SmolLM2-135M-Instruct (``kvtier.models.smollm2``, fp32); a real
``kvtier serve`` child holds the segments in L1; the task is the retrieval
task (``kvtier.bench.retrieval``). Every prompt goes through:

- *full prefill* (no cache): the reference, its greedy answer up to
  ``generated`` tokens (stopping after the end-of-turn token);
- *prefix-only reuse* through the same server (kvtier's exact prefix chunks;
  every document was seen once right after the system prompt beforehand);
- one *blend* per configuration (``configurations``): kvtier's blend (the
  ``question`` selection over documents anchored on the system prompt) at
  each recompute ratio; the static option; at 0.15 the ``impact``
  selection, CacheBlend's own (``deviation`` over documents computed
  alone), the deviation selection over anchored documents (the anchor
  alone) and the bottom-right mask.

Per blend, against full prefill: teacher-forced top-1 agreement over full
prefill's generated tokens (the blend's argmax at each position, the
previous tokens being full prefill's), the mean KL(full || blend) of the
next-token distributions there, greedy-output equality (every position
agrees: greedy decoding would give the same text), whether its answer is
right (its own greedy output, decoded only where it differs from full
prefill's), its TTFT and its prefill work (token-layers run / full
prefill's). Summaries are over all prompts, and *retention* over the
prompts full prefill answers right: the share each blend still answers
right. Where the answers go: whether a wrong answer is another document's
code or none, and retention apart over the surer and the less sure half of
full prefill's right answers, by their *margin* (the least lead in
probability of full prefill's chosen token over the runner-up, over the
tokens that spell the code): how much an answer a blend loses was already
a near thing. A latency set (4 documents, 1.5-3 K tokens) times full
prefill, prefix-only reuse and the blends on the same prompts, documents
warm in L1 (each blend runs its prompt once untimed first, so its documents
are stored at the offsets it computes them at).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench.retrieval import (
    SYSTEM,
    Document,
    Prompt,
    RetrievalSpec,
    document_pool,
    retrieval_prompts,
    tokenize,
)
from kvtier.blend import BlendConfig
from kvtier.engine.hf import KVTierModel, Prefill, cache_argument
from kvtier.process import ServerProcess

END_OF_TURN = "<|im_end|>"


# The other blends compared at ratio 0.15, each beside kvtier's default
COMPARISONS = {
    "impact": BlendConfig(ratio=0.15, selection="impact"),  # the default until 2026-12-04
    "CacheBlend": BlendConfig(ratio=0.15, selection="deviation", anchor=False),
    "deviation": BlendConfig(ratio=0.15, selection="deviation"),  # anchored
    "bottom-right": BlendConfig(ratio=0.15, mask="bottom_right"),
}


def configurations(
    ratios: Sequence[float], static: Sequence[float], compare: Sequence[str] = tuple(COMPARISONS)
) -> dict[str, BlendConfig]:
    """The blends compared: kvtier's default blend at every ratio; static at
    ``static``; at 0.15 the ``compare`` ones of ``COMPARISONS`` (the impact
    selection, CacheBlend's own: deviation over documents alone, deviation
    over anchored documents, the bottom-right mask)."""
    unknown = sorted(set(compare) - set(COMPARISONS))
    if unknown:
        raise ValueError(f"--compare: unknown {unknown}; choose from {', '.join(COMPARISONS)}")
    out = {f"blend {r:g}": BlendConfig(ratio=r) for r in ratios}
    out |= {f"{name} 0.15": COMPARISONS[name] for name in compare}
    out |= {f"static {r:g}": BlendConfig(ratio=r, selection="static") for r in static}
    if not out:
        raise ValueError("no blend to measure: give --ratios, --static or --compare")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendEvalRequest:
    spec: RetrievalSpec = field(default_factory=RetrievalSpec)
    latency_prompts: int = 24
    ratios: tuple[float, ...] = (0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 1.0)
    static: tuple[float, ...] = (0.15, 0.3)
    compare: tuple[str, ...] = tuple(COMPARISONS)
    generated: int = 32
    l1_size: str = "8GiB"
    out: Path = Path("kvtier-blend-eval")
    command: str = ""
    resume: bool = False  # keep the rows in out/prompts.jsonl and run the prompts after them

    def __post_init__(self) -> None:
        configurations(self.ratios, self.static, self.compare)  # names checked before any work


@dataclass(slots=True)
class Measured:
    """One configuration on one prompt."""

    ttft_s: float
    work: float = 1.0
    agreement: float = 1.0
    kl: float = 0.0
    equal: bool = True
    correct: bool = False
    answered: str = ""  # Prompt.answered of its greedy answer: asked, another or none
    hit_tokens: int = 0
    computed_alone_tokens: int = 0  # a blend's segments not found (computed alone)


def warm_segments(
    engine: KVTierModel,
    tokenizer: Any,
    pool: Sequence[Document],
    anchors: Sequence[bool] = (True,),
    prefix: bool = False,
) -> None:
    """Store every document of ``pool`` as a segment (after the system prompt
    for each anchored choice in ``anchors``, alone for False), and with
    ``prefix`` also right after the system prompt as prefix chunks: a blend
    that comes after finds them and moves them."""
    for document in pool:
        ids, spans = tokenize(Prompt((SYSTEM, document.text, END_OF_TURN), (), 0, ""), tokenizer)
        for anchor in anchors:
            engine.prefill(ids, segments=spans, blend=BlendConfig(ratio=0.0, anchor=anchor))
        if prefix:
            engine.prefill(ids[: spans[-1][1]])


class _Runner:
    def __init__(self, model: Any, tokenizer: Any, server: ServerProcess, generated: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reference = KVTierModel(model)
        self.engine = KVTierModel(model, server=server.rpc, name="SmolLM2-135M-Instruct")
        self.eos = int(tokenizer.convert_tokens_to_ids(END_OF_TURN))
        self.generated = generated
        self._cache_argument = cache_argument(model)

    def close(self) -> None:
        self.engine.close()

    def tokens(self, prompt: Prompt) -> tuple[list[int], list[tuple[int, int]]]:
        return tokenize(prompt, self.tokenizer)

    def warm(self, pool: list[Document]) -> None:
        """Every document once: as a segment (after the system prompt, and
        alone), and right after the system prompt (the prefix chunks
        prefix-only reuse can find)."""
        warm_segments(self.engine, self.tokenizer, pool, anchors=(True, False), prefix=True)

    def full(self, ids: list[int]) -> tuple[list[int], torch.Tensor, float]:
        """Full prefill's greedy answer, the logits each token came from, its TTFT."""
        generation = self.reference.generate(ids, self.generated, self.eos)
        return generation.tokens, generation.logits, generation.prefill.timings.ttft_s

    def prefix_only(self, ids: list[int]) -> Measured:
        prefill = self.engine.prefill(ids)
        work = prefill.computed_tokens / len(ids)
        return Measured(prefill.timings.ttft_s, work=work, hit_tokens=prefill.hit_tokens)

    def blend(
        self,
        prompt: Prompt,
        ids: list[int],
        spans: list[tuple[int, int]],
        config: BlendConfig,
        answer: list[int],
        reference: torch.Tensor,
        full_answered: str,
    ) -> Measured:
        prefill = self.engine.prefill(ids, segments=spans, blend=config)
        assert prefill.blend is not None
        logits = self._teacher_forced(prefill, answer)
        agree = logits.argmax(-1) == torch.tensor(answer)
        kl = torch.nn.functional.kl_div(
            logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
        ).sum(-1)
        equal = bool(agree.all())
        if equal:
            answered = full_answered
        else:
            output = self.engine.decode(prefill, self.generated, self.eos).tokens
            answered = prompt.answered(self.tokenizer.decode(output))
        return Measured(
            prefill.timings.ttft_s,
            work=prefill.blend.work,
            agreement=float(agree.float().mean()),
            kl=float(kl.mean()),
            equal=equal,
            correct=answered == "asked",
            answered=answered,
            hit_tokens=prefill.hit_tokens,
            computed_alone_tokens=prefill.blend.computed_alone_tokens,
        )

    @torch.inference_mode()
    def _teacher_forced(self, prefill: Prefill, answer: list[int]) -> torch.Tensor:
        """Logits at every answer position, the tokens before each being the
        answer's; the prefill's cache is cropped back afterwards."""
        rows = [prefill.logits[None]]
        if len(answer) > 1:
            out = self.model(
                input_ids=torch.tensor([answer[:-1]]),
                use_cache=True,
                **{self._cache_argument: prefill.cache},
            )
            rows.append(out.logits[0].float())
            prefill.cache.crop(1 - len(answer))  # drop what was appended
        return torch.cat(rows)


def margin(logits: torch.Tensor) -> float:
    """The least lead, in probability, of each row's top token over its
    runner-up (``logits``: ``[tokens, vocab]``): how little it takes to flip
    one of those tokens of a greedy answer."""
    top = logits.float().softmax(-1).topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def spelling(tokenizer: Any, tokens: list[int], text: str) -> list[int] | None:
    """The indices of the ``tokens`` whose decoded text spells ``text`` (its
    first occurrence), or None where the decoded tokens do not hold it."""
    start = tokenizer.decode(tokens).find(text)
    if start < 0:
        return None
    ends = [len(tokenizer.decode(tokens[: i + 1])) for i in range(len(tokens))]
    first = next(i for i, end in enumerate(ends) if end > start)
    last = next(i for i, end in enumerate(ends) if end >= start + len(text))
    return list(range(first, last + 1))


RESAMPLES = 4000  # bootstrap resamples of the prompts for a 95 % interval


def interval(values: Sequence[float]) -> list[float] | None:
    """A 95 % percentile-bootstrap interval of the mean of ``values`` (the
    prompts resampled ``RESAMPLES`` times, a fixed seed: the same rows give
    the same interval); None for no values."""
    if not values:
        return None
    data = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, len(data), (RESAMPLES, len(data)))
    low, high = np.percentile(data[picks].mean(axis=1), [2.5, 97.5])
    return [round(float(low), 4), round(float(high), 4)]


@dataclass(frozen=True, slots=True)
class MarginHalves:
    """Full prefill's right answers split at their median margin (rows
    without a margin, measured before margins were kept, are in neither)."""

    median: float | None
    margins: list[float]
    surer: list[dict[str, Any]]
    less_sure: list[dict[str, Any]]

    @classmethod
    def of(cls, right: list[dict[str, Any]]) -> MarginHalves:
        measured = [(r, m) for r in right if (m := r.get("margin")) is not None]
        margins = sorted(m for _, m in measured)
        median = statistics.median(margins) if margins else None
        surer = [r for r, m in measured if median is not None and m >= median]
        less_sure = [r for r, m in measured if median is not None and m < median]
        return cls(median, margins, surer, less_sure)

    def summary(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "range": [self.margins[0], self.margins[-1]] if self.margins else None,
            "surer_half": len(self.surer),
            "less_sure_half": len(self.less_sure),
        }

    def retention(self, name: str) -> dict[str, float | None]:
        """The share of each half that configuration ``name`` keeps right."""
        return {
            "retention_surer_half": _kept(self.surer, name),
            "retention_less_sure_half": _kept(self.less_sure, name),
        }


def _kept(rows: list[dict[str, Any]], name: str) -> float | None:
    return round(sum(r[name]["correct"] for r in rows) / len(rows), 3) if rows else None


def summarize(rows: list[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Means over prompts; retention over those full prefill gets right, and
    apart over the surer half of them (margin at or above the median) and
    the less sure half (rows measured before margins were kept are in
    neither); where wrong answers go."""
    right = [r for r in rows if r["full"]["correct"]]
    halves = MarginHalves.of(right)
    summary: dict[str, Any] = {
        "prompts": len(rows),
        "full_prefill_accuracy": round(len(right) / max(len(rows), 1), 3),
        "full_prefill_correct": len(right),
        "full_prefill_another_code": sum(r["full"].get("answered") == "another" for r in rows),
        "full_prefill_margin": halves.summary(),
    }
    for name in ["prefix-only", *names]:
        got = [r[name] for r in rows]
        entry = {
            "ttft_p50_s": round(statistics.median(m["ttft_s"] for m in got), 4),
            "work": round(statistics.fmean(m["work"] for m in got), 4),
        }
        if name != "prefix-only":
            entry |= {
                "top1_agreement": round(statistics.fmean(m["agreement"] for m in got), 4),
                "top1_agreement_ci95": interval([m["agreement"] for m in got]),
                "kl": round(statistics.fmean(m["kl"] for m in got), 4),
                "greedy_equal": round(statistics.fmean(m["equal"] for m in got), 3),
                "accuracy": round(statistics.fmean(m["correct"] for m in got), 3),
                "retention": round(sum(r[name]["correct"] for r in right) / max(len(right), 1), 3),
                "retention_ci95": interval([float(r[name]["correct"]) for r in right]),
                **halves.retention(name),
                "lost_to_another_code": sum(r[name].get("answered") == "another" for r in right),
                "segments_all_found": round(
                    statistics.fmean(m["computed_alone_tokens"] == 0 for m in got), 3
                ),
            }
        summary[name] = entry
    full = statistics.median(r["full"]["ttft_s"] for r in rows)
    summary["full"] = {"ttft_p50_s": round(full, 4), "work": 1.0}
    return summary


def latency(rows: list[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """TTFT p50 per configuration and its ratio to full prefill and prefix-only."""
    full = statistics.median(r["full_ttft_s"] for r in rows)
    prefix = statistics.median(r["prefix-only"] for r in rows)
    out: dict[str, Any] = {
        "prompts": len(rows),
        "prompt_tokens_p50": statistics.median(r["tokens"] for r in rows),
        "prompt_tokens_range": [min(r["tokens"] for r in rows), max(r["tokens"] for r in rows)],
        "full": {"ttft_p50_s": round(full, 4)},
        "prefix-only": {"ttft_p50_s": round(prefix, 4), "speedup_vs_full": round(full / prefix, 2)},
    }
    for name in names:
        if name not in rows[0]:
            continue
        p50 = statistics.median(r[name] for r in rows)
        out[name] = {
            "ttft_p50_s": round(p50, 4),
            "speedup_vs_full": round(full / p50, 2),
            "speedup_vs_prefix_only": round(prefix / p50, 2),
        }
    return out


def latency_spec(spec: RetrievalSpec, prompts: int) -> RetrievalSpec:
    """The latency set's task: ``prompts`` prompts of 4 documents of 300-450
    words (1.5-3 K tokens), otherwise ``spec``'s (pool size, code placement),
    from another seed."""
    return replace(
        spec,
        prompts=max(prompts, 1),  # none are made with --latency-prompts 0
        documents=(4, 4),
        words=(300, 450),
        seed=spec.seed + 7,
    )


def run_blend_eval(
    request: BlendEvalRequest, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    from kvtier.models import smollm2

    torch.set_grad_enabled(False)
    request.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = smollm2()
    names = configurations(request.ratios, request.static, request.compare)
    pool = document_pool(request.spec)
    prompts = retrieval_prompts(request.spec, pool)
    timed_spec = latency_spec(request.spec, request.latency_prompts)
    args = ["--port", "0", "--http-port", "-1", "--l1-size", request.l1_size]
    args += ["--cache-dir", "none"]
    started = time.perf_counter()
    rows_path = request.out / "prompts.jsonl"
    done = _rows_to_resume(rows_path, names)[: len(prompts)] if request.resume else []
    rows: list[dict[str, Any]] = list(done)
    timed: list[dict[str, Any]] = []
    with (
        ServerProcess.start(args, request.out / "kvtier-serve.log") as server,
        rows_path.open("a" if request.resume else "w") as per_prompt,
    ):
        runner = _Runner(model, tokenizer, server, request.generated)
        try:
            for i, row in enumerate(done):
                if len(runner.tokens(prompts[i])[0]) != row["tokens"]:
                    raise ValueError(
                        f"{rows_path}: row {i + 1} is not this task's prompt {i + 1} "
                        "(another --seed?); resume with the same options or use another --out"
                    )
            if len(done) < len(prompts):
                runner.warm(pool)
                progress(f"warmed {len(pool)} documents; {len(done)} prompts kept")
            for i, prompt in enumerate(prompts[len(done) :], start=len(done)):
                rows.append(_quality_row(runner, prompt, names))
                per_prompt.write(json.dumps(rows[-1]) + "\n")  # kept if the run stops early
                per_prompt.flush()
                progress(f"prompt {i + 1}/{len(prompts)}")
            if request.latency_prompts:
                latency_pool = document_pool(timed_spec)
                runner.warm(latency_pool)
                for prompt in retrieval_prompts(timed_spec, latency_pool):
                    timed.append(_latency_row(runner, prompt, names))
                progress("latency set done")
        finally:
            runner.close()
    results = {
        "command": request.command,
        "model": "SmolLM2-135M-Instruct (fp32, dequantized from Q4_1)",
        "spec": asdict(request.spec),
        "configurations": {n: asdict(c) for n, c in names.items()},
        "quality": summarize(rows, list(names)),
        "latency": latency(timed, list(names)) if timed else None,  # None: --latency-prompts 0
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (request.out / "blend-eval.json").write_text(json.dumps(results, indent=1))
    return results


def _rows_to_resume(path: Path, names: dict[str, BlendConfig]) -> list[dict[str, Any]]:
    """The rows an earlier run wrote, checked to hold every configuration."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        missing = [name for name in ("full", *names) if name not in row]
        if missing:
            raise ValueError(
                f"{path}: row {i + 1} has no {', '.join(missing)}; resume with the same "
                "--ratios, --static and --compare, or use another --out"
            )
    return rows


def _quality_row(runner: _Runner, prompt: Prompt, names: dict[str, BlendConfig]) -> dict[str, Any]:
    ids, spans = runner.tokens(prompt)
    answer, reference, ttft = runner.full(ids)
    text = runner.tokenizer.decode(answer)
    answered = prompt.answered(text)
    full = Measured(ttft, correct=answered == "asked", answered=answered)
    code = spelling(runner.tokenizer, answer, prompt.answer)  # None: full prefill is wrong
    row: dict[str, Any] = {
        "tokens": len(ids),
        "documents": len(prompt.documents),
        "answer": text,
        "margin": None if code is None else round(margin(reference[code]), 4),
        "full": asdict(full),
        "prefix-only": asdict(runner.prefix_only(ids)),
    }
    for name, config in names.items():
        measured = runner.blend(prompt, ids, spans, config, answer, reference, answered)
        row[name] = asdict(measured)
    return row


def _latency_row(runner: _Runner, prompt: Prompt, names: dict[str, BlendConfig]) -> dict[str, Any]:
    ids, spans = runner.tokens(prompt)
    row: dict[str, Any] = {
        "tokens": len(ids),
        "full_ttft_s": runner.reference.prefill(ids).timings.ttft_s,
        "prefix-only": runner.prefix_only(ids).ttft_s,
    }
    for name, config in names.items():
        if config.ratio < 1.0:  # ratio 1 is full prefill's work
            # untimed first: the documents at these offsets (BlendConfig.at_offset) are stored
            runner.engine.prefill(ids, segments=spans, blend=config)
            row[name] = runner.engine.prefill(ids, segments=spans, blend=config).timings.ttft_s
    return row


__all__ = [
    "COMPARISONS",
    "BlendEvalRequest",
    "MarginHalves",
    "configurations",
    "latency_spec",
    "margin",
    "run_blend_eval",
    "spelling",
    "summarize",
]
