"""A Mooncake-format trace of conversations, written for tests: sessions
whose turns extend their previous prompt (prefix-chained block ids), under
one shared first block, with seeded lengths and arrivals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 512


def conversation_rows(requests: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    next_id = 1  # id 0: the shared first block (a system prompt)
    sessions: list[list[int]] = []  # each session's token count so far, by its blocks
    lengths: list[int] = []
    rows, now = [], 0.0
    for _ in range(requests):
        now += float(rng.exponential(250.0))
        if not sessions or rng.random() < 0.3:
            sessions.append([0])
            lengths.append(BLOCK)
        s = int(rng.integers(len(sessions)))
        grown = lengths[s] + int(rng.integers(1, 3 * BLOCK))
        blocks = sessions[s]
        # the previous turn's last block was partial: the new turn's block there is new
        if lengths[s] % BLOCK:
            blocks = blocks[:-1]
        while len(blocks) < math.ceil(grown / BLOCK):
            blocks = [*blocks, next_id]
            next_id += 1
        sessions[s], lengths[s] = blocks, grown
        rows.append(
            {
                "timestamp": int(now),
                "input_length": grown,
                "output_length": int(rng.integers(1, 400)),
                "hash_ids": list(blocks),
            }
        )
    return rows


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
