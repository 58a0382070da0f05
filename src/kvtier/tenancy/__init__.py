"""Who owns what on a node: tenants and their tokens, quotas and rates
(``tenants``), L2 usage (``usage``), retention, purge by selector, and the
savings ledger. Shared by the cache server and the router."""
