"""The server's side of the prefill/decode hand-off: the table of hand-offs
it holds (``table``), the OFFER/TAKE/DONE requests (``requests``) and the
re-sharding of a producer's objects for a consumer of another TP size
(``conversion``). The vocabulary is ``kvtier.protocol.handoff``."""
