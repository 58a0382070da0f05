"""``kvtier pd-proxy``: prefill on one engine, decode on another
(``proxy``), speaking the OpenAI API to clients (``api``)."""
