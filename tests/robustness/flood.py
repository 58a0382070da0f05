"""A client that registers under ever new model names, for the
``bounded_memory`` rule: one raw connection of tenant ``acme`` sends HELLO
under a name it never used before, then a quality-gate report and a usage
report for that namespace, as fast as the server answers, until stopped.

Every table keyed by a namespace (the quality board, the savings ledger,
what /status remembers of registrations) sees a new key per name; the
``Monitor`` samples their sizes and the server's RSS. A call the server does
not answer in time (a fault) costs the socket: a fresh one is made, so a late
reply is never taken for the next call's.
"""

from __future__ import annotations

import zmq

from kvtier.protocol import messages as p
from tests.integration import workload as w
from tests.robustness.background import Background
from tests.robustness.cluster import TIMEOUT_S, TOKENS, Cluster
from tests.robustness.history import History

TENANT = "acme"
MAX_NAMES = 5000  # per run: thousands, as the rule asks, whatever the run's length


class NameFlood(Background):
    """Runs on its own thread until ``stop`` is set; ``names`` counts the
    namespaces it registered (HELLO answered with WELCOME)."""

    def __init__(self, cluster: Cluster, history: History, seed: int) -> None:
        super().__init__("flood")
        self.cluster, self.history, self.seed = cluster, history, seed
        self.names = 0

    def _run(self) -> None:
        with self.history.record("flood", "flood", tenant=TENANT) as op:
            tried = 0
            while not self.stop.is_set() and tried < MAX_NAMES:
                with w.raw_dealer(self.cluster.server.rpc) as socket:
                    while not self.stop.is_set() and tried < MAX_NAMES:
                        tried += 1
                        if not self._one_name(socket, tried):
                            break  # no answer in time: a fresh socket
            op.outcome, op.result = "ok", {"tried": tried, "registered": self.names}

    def _one_name(self, socket: zmq.Socket[bytes], n: int) -> bool:
        """Register name ``n`` and report under it; False if a call went unanswered."""
        hello = p.Hello(
            p.PROTOCOL_VERSION,
            f"flood-{n}",
            f"flood/{self.seed}-{n}",
            [w.LAYOUT],
            token=TOKENS[TENANT],
        )
        reports = (
            p.QualityReport("blend", n % 3 != 0, 0.1 * (n % 7), off=n % 5 == 0),
            p.UsageReport(0.0256, 256, 0.001, 256),
        )
        for message in (hello, *reports):
            w.send_raw(socket, [p.encode(message)])
            if not socket.poll(int(TIMEOUT_S * 1000)):
                return False
            reply = p.decode_reply(socket.recv_multipart()[0])
            if message is hello and not isinstance(reply, p.Welcome):
                return True  # refused (e.g. the server is draining): try the next name
        self.names += 1
        return True
