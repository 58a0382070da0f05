"""The router's scoring path with a large index: 1 M kvtier chunks over 64 nodes.

The index is filled through ``ChunkIndex.apply`` with the events the cache
servers would send: ``--docs`` documents, each a chain of ``--doc-chunks``
chunks hashed as the engines hash them (one tenant), each held by 3 random
nodes in L1, a node-local L2 or the shared store, until the index holds
``--chunks`` chunks. The engines' own prefix caches (``BlockIndex``) hold
the first 16-token blocks of some documents too. A request is one random
document's prefix plus a fresh suffix (``--prompt-tokens`` in all).

Timed per request: ``Router.route`` (hash the prompt, read both indexes,
build the 64 candidates, plan each, pick), for each policy. Baseline in the
same run: hashing the prompt alone (``TokenHasher.chunk_hashes``), the part
every engine connector pays too.

    python benchmarks/bench_route_scoring.py [--chunks 1000000] [--nodes 64] [--requests 2000]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from common import percentile, report
from kvtier.events.wire import BlockStored, DecodedBatch
from kvtier.router.core import Node, Router
from kvtier.router.scoring import POLICIES

NAMESPACE = {
    "model": "bench/model",
    "revision": "r1",
    "lora": "",
    "kv_dtype": "bfloat16",
    "layout": "0" * 32,
    "chunk_size": 256,
}
TIERS = (("L1", "LOCAL"), ("fs", "LOCAL"), ("shared", "SHARED"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--doc-chunks", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    nodes = [Node(i, f"node{i}", f"http://127.0.0.1:{8000 + i}") for i in range(args.nodes)]
    router = Router(nodes, policy="kvtier")
    router.set_namespace(NAMESPACE)
    size = int(NAMESPACE["chunk_size"])
    docs = []
    started = time.perf_counter()
    while len(router.chunks) < args.chunks:
        tokens = rng.integers(0, 50_000, args.doc_chunks * size, dtype=np.uint32)
        hashes, _ = router.chunk_hashes(tokens, "tenant")
        docs.append(tokens)
        for node in rng.choice(args.nodes, 3, replace=False):
            tier, locality = TIERS[rng.integers(0, 3)]
            held = hashes[: rng.integers(1, len(hashes) + 1)]
            event = BlockStored(
                list(held), ownership=f"kvtier:{tier}", locality=locality, medium="CPU"
            )
            router.chunks.apply(int(node), DecodedBatch(0.0, [event], None, 0))
        if len(docs) % 4 == 0:  # an engine holds the start of every 4th document itself
            blocks = 64
            event = BlockStored(
                [int(x) for x in rng.integers(0, 2**62, blocks)],
                None,
                [int(t) for t in tokens[: blocks * 16]],
                16,
                None,
                "GPU",
                None,
                extra_keys=[["tenant"]] + [None] * (blocks - 1),
            )
            engine = int(rng.integers(0, args.nodes))
            router.blocks.apply(engine, DecodedBatch(0.0, [event], None, 0))
    fill_s = time.perf_counter() - started
    gc.collect()
    gc.freeze()  # the index's objects are long-lived: keep the collector off them

    prompts = []
    for _ in range(args.requests):
        doc = docs[rng.integers(0, len(docs))]
        suffix = rng.integers(0, 50_000, max(args.prompt_tokens - len(doc), 0), dtype=np.uint32)
        prompts.append(np.concatenate([doc, suffix])[: args.prompt_tokens])

    hash_s = []
    for tokens in prompts:
        t0 = time.perf_counter()
        router.chunk_hashes(tokens, "tenant")
        hash_s.append(time.perf_counter() - t0)
    results: dict[str, object] = {
        "chunks": len(router.chunks),
        "nodes": args.nodes,
        "prompt_tokens": args.prompt_tokens,
        "fill_s": round(fill_s, 1),
        "hash_p50_us": round(percentile(hash_s, 50) * 1e6, 1),
        "hash_p99_us": round(percentile(hash_s, 99) * 1e6, 1),
    }
    rows = [
        ("index", f"{len(router.chunks):,} chunks, {args.nodes} nodes, filled in {fill_s:.1f} s"),
        (
            "baseline: hash the prompt",
            f"p50 {results['hash_p50_us']} us  p99 {results['hash_p99_us']} us",
        ),
    ]
    for policy in POLICIES:
        router.policy_name, router.policy = policy, POLICIES[policy]()
        route_s = []
        for tokens in prompts:
            t0 = time.perf_counter()
            router.route(tokens, "tenant")
            route_s.append(time.perf_counter() - t0)
        p50, p99 = percentile(route_s, 50) * 1e6, percentile(route_s, 99) * 1e6
        results[f"{policy}_p50_us"] = round(p50, 1)
        results[f"{policy}_p99_us"] = round(p99, 1)
        rows.append((f"route ({policy})", f"p50 {p50:.0f} us  p99 {p99:.0f} us"))
    report("router scoring path", rows, results)


if __name__ == "__main__":
    main()
