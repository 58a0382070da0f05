"""The node's shared cache server (``kvtier serve``).

``core`` (operations and sessions), ``transport`` (the ZeroMQ loop),
``sessions``, ``limits``, ``requests`` and ``registrations`` (one client's
state and its requests), the hand-off table (``handoffs``, ``handoff_requests``,
``handoff_conversion``), ``warmup`` and ``config``. Engines talk to it through
``kvtier.protocol``; its operator plane is ``kvtier.operations``.
"""
