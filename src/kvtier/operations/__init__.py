"""The cache server's operator plane: the admin HTTP server and its API
(``admin``, ``admin_api``), the dashboard and the Prometheus exporter."""
