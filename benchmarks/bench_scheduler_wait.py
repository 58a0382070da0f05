"""How long vLLM's scheduler thread waits in kvtier's connector per step,
while lookups are slow and while the cache server is away.

The connector's scheduler side (``SchedulerSide``, no engine: requests and
scheduler outputs are stand-ins, as in its tests) against a real ``kvtier
serve`` whose only L2 is a mock with ``--l2-latency`` seconds per task, so a
new request's lookup stays pending that long. Each simulated step admits
``--arrivals`` new requests (8 chunks each, never seen before), asks every
waiting one again, and builds the step's metadata; a 10 ms sleep stands for
the forward. Phases:

- *slow L2*: the server answers after its L2 lookups (pending for a while);
- *away*: the server is killed; the connector's clients find it gone;
- *back*: a new server on the same port; the clients reconnect on their own.

Reported per phase: the connector's time per step (p50, p99, max) against
the ``kvtier.lookup_wait_s`` budget (what new requests' first lookups may
block, together, per step), and how the lookups ended.

    python benchmarks/bench_scheduler_wait.py [--steps 200] [--arrivals 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from common import percentile, report
from kvtier.engine.vllm.scheduler import SchedulerSide
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.process import ServerProcess

BLOCK, CHUNK = 128, 256


class ModelConfig:
    """What the connector reads of vLLM's model config: a 2-layer fp32 Llama."""

    model, revision, dtype, use_mla = "bench/tiny", "r1", "float32", False
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "rope_theta": 1e4})

    def get_num_layers(self, parallel: Any) -> int:
        return 2

    def get_num_kv_heads(self, parallel: Any) -> int:
        return 2

    def get_total_num_kv_heads(self) -> int:
        return 2

    def get_head_size(self) -> int:
        return 64


VLLM_CONFIG = SimpleNamespace(
    model_config=ModelConfig(),
    parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
    cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
)
IDLE_STEP = SimpleNamespace(
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    ),
    num_scheduled_tokens={},
)


def run_steps(side: SchedulerSide, steps: int, arrivals: int, seed: int) -> list[float]:
    """Connector seconds per step; every request is finished once answered."""
    rng = np.random.default_rng(seed)
    waiting: list[Any] = []
    per_step = []
    for step in range(steps):
        started = time.perf_counter()
        for i in range(arrivals):
            prompt = [int(t) for t in rng.integers(2, 30000, 8 * CHUNK + 10)]
            waiting.append(
                SimpleNamespace(
                    request_id=f"{seed}-{step}-{i}",
                    prompt_token_ids=prompt,
                    num_tokens=len(prompt),
                    num_preemptions=0,
                    cache_salt=None,
                )
            )
        still = []
        for request in waiting:
            matched, _ = side.get_num_new_matched_tokens(request, 0)
            if matched is None:
                still.append(request)
            else:
                side.request_finished(request, [])
        waiting = still
        side.build_connector_meta(IDLE_STEP)
        per_step.append(time.perf_counter() - started)
        time.sleep(0.01)  # the forward
    for request in waiting:
        side.request_finished(request, [])
    return per_step


def summary(per_step: list[float], outcomes: dict[str, int]) -> dict[str, Any]:
    return {
        "steps": len(per_step),
        "p50_ms": statistics.median(per_step) * 1e3,
        "p99_ms": percentile(per_step, 99) * 1e3,
        "max_ms": max(per_step) * 1e3,
        "lookups": outcomes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--arrivals", type=int, default=2, help="new requests per step")
    parser.add_argument("--l2-latency", type=float, default=0.2)
    parser.add_argument("--lookup-wait", type=float, default=0.02)
    args = parser.parse_args()
    l2 = json.dumps({"type": "mock", "latency_s": args.l2_latency})
    with tempfile.TemporaryDirectory() as tmp:
        serve = ["--port", "0", "--http-port", "0", "--l1-size", "64MiB", "--cache-dir", "none"]
        serve += ["--chunk-size", str(CHUNK), "--l2", l2]
        server = ServerProcess.start(serve, Path(tmp) / "kvtier.log")
        settings = ConnectorSettings(
            address=server.rpc, lookup_wait_s=args.lookup_wait, request_timeout_s=0.5
        )
        side = SchedulerSide(VLLM_CONFIG, settings)
        results: dict[str, Any] = {"budget_ms": args.lookup_wait * 1e3}
        try:
            seen: dict[str, int] = {}

            def phase(name: str, seed: int) -> None:
                per_step = run_steps(side, args.steps, args.arrivals, seed)
                outcomes = side.outcomes.snapshot()
                results[name] = summary(
                    per_step, {k: v - seen.get(k, 0) for k, v in outcomes.items()}
                )
                seen.update(outcomes)

            phase("slow L2", 1)
            port = str(server.port)
            server.stop()
            phase("away", 2)
            server = ServerProcess.start(["--port", port, *serve[2:]], Path(tmp) / "back.log")
            phase("back", 3)
        finally:
            side.close()
            server.stop()
    rows = [
        (
            name,
            f"per step p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.2f} ms  max {r['max_ms']:.2f} ms"
            f"  lookups {r['lookups']}",
        )
        for name, r in results.items()
        if name != "budget_ms"
    ]
    rows.append(("budget (kvtier.lookup_wait_s)", f"{results['budget_ms']:.0f} ms per step"))
    report("The vLLM scheduler thread's time in kvtier's connector", rows, results)


if __name__ == "__main__":
    main()
