"""The node's shared cache server (``kvtier serve``) and its client.

``protocol`` (wire messages), ``core`` (operations and sessions),
``transport`` (the ZeroMQ loop), ``admin`` (HTTP), ``config`` and ``main``
(``kvtier serve``), and ``client`` (``CacheClient``, used by engines).
"""
