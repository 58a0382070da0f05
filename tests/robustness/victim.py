"""A client process the robustness runner kills mid-operation.

``python -m tests.robustness.victim ADDRESS TOKEN SEED MODE`` registers
under the tenant of TOKEN and stops inside an operation, printing one line
first: ``mid-store`` inside a store's fill (its reservation open),
``mid-retrieve`` inside a retrieve's consume (its read locks held). Its
client thread keeps pinging, so only its death frees what it holds.
"""

from __future__ import annotations

import sys
import time

from kvtier.protocol.client import CacheClient, ObjectBytes
from tests.integration import workload as w


def _block(i: int, view: ObjectBytes) -> None:
    print("holding", flush=True)
    while True:
        time.sleep(60)


def main() -> None:
    address, token, seed, mode = sys.argv[1:5]
    client = CacheClient(w.client_config(address, auth_token=token))
    size = w.object_bytes(client.chunk_size or 256)
    hashes = w.chunk_hashes(client.chunk_size or 256, int(seed), 2)
    if mode == "mid-store":
        client.store_with("victim", hashes, [size] * 2, _block)
    else:
        client.store("victim-store", hashes, w.payloads(int(seed), 2, size))
        state = client.lookup("victim", hashes, wait_s=5.0)
        client.retrieve_with("victim", 0, state.hit_chunks or 1, _block)
    print("nothing held", flush=True)  # the store or lookup did not get that far


if __name__ == "__main__":
    main()
