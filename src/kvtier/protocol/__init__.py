"""What crosses the wire between engines and the node's cache server.

``messages`` (the wire messages), ``negotiation`` (the HELLO handshake),
``client`` (``CacheClient``, which engines import) over ``connection``,
``handoff`` (the prefill/decode hand-off's parameters and outcomes) and
``status`` (the ``/status`` document, typed).
"""
