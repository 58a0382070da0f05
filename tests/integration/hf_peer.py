"""An engine process for the transformers sharing test.

``python -m tests.integration.hf_peer --server RPC --model-dir DIR
--prefix-seed P --prefix-tokens N --prompt-seed S --prompt-tokens M
[--new-tokens K] [--wait]`` loads the model saved in DIR (fp32), generates
greedily through the kvtier server at RPC for the prompt ``build_prompt(P, N,
S, M)`` (so peers with the same prefix seed share N tokens) and prints one
JSON line: tokens, logits (a nested list), prompt_tokens, hit_tokens,
stored_tokens, load_failed and the server's chunk size. With ``--wait`` it
reads one line from stdin after loading, before the request: a test can
start several peers at once and let them run in the order it needs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from kvtier.engine.hf import KVTierModel
from tests.hf_helpers import VOCAB, prompt


def build_prompt(
    prefix_seed: int, prefix_tokens: int, prompt_seed: int, prompt_tokens: int, vocab: int = VOCAB
) -> list[int]:
    return prompt(prefix_seed, prefix_tokens, vocab) + prompt(prompt_seed, prompt_tokens, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.hf_peer")
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prefix-seed", type=int, required=True)
    parser.add_argument("--prefix-tokens", type=int, required=True)
    parser.add_argument("--prompt-seed", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--wait", action="store_true", help="read a line from stdin first")
    args = parser.parse_args()

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    ids = build_prompt(
        args.prefix_seed,
        args.prefix_tokens,
        args.prompt_seed,
        args.prompt_tokens,
        model.config.vocab_size,
    )
    with KVTierModel(model, server=args.server, client_options={"heartbeat_s": 0}) as engine:
        if args.wait:
            sys.stdin.readline()
        out = engine.generate(ids, args.new_tokens)
        link_chunk_size = engine.link.chunk_size if engine.link is not None else None
    p = out.prefill
    print(
        json.dumps(
            {
                "tokens": out.tokens,
                "logits": out.logits.tolist(),
                "prompt_tokens": p.prompt_tokens,
                "hit_tokens": p.hit_tokens,
                "stored_tokens": p.stored_tokens,
                "load_failed": p.load_failed,
                "chunk_size": link_chunk_size,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
