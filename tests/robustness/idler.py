"""An engine's client at rest, for the ``server_away`` fault.

``python -m tests.robustness.idler ADDRESS TOKEN HEARTBEAT_S`` registers
under the tenant of TOKEN with a heartbeat every HEARTBEAT_S, prints
``ready`` and then makes no call: only its client thread runs, as in an
engine between requests. The fault reads its CPU time while the cache
server is away, and ends it by closing its stdin.
"""

from __future__ import annotations

import sys

from kvtier.protocol.client import CacheClient
from tests.integration import workload as w


def main() -> None:
    address, token, heartbeat_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = CacheClient(
        w.client_config(address, auth_token=token, heartbeat_s=heartbeat_s, request_timeout_s=2.0)
    )
    print("ready" if not client.degraded else "degraded", flush=True)
    sys.stdin.read()  # until the fault is done with it
    client.close()


if __name__ == "__main__":
    main()
