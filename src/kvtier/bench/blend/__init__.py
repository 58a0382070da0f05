"""``kvtier blend-eval``: CacheBlend's quality and speed against full prefill on
a real model (``evaluation``), and its report (``report``)."""
