"""The ``kvtier`` command line: ``cli`` dispatches to ``serve``, ``admin``,
``demo``, ``selfcheck`` and ``config_docs`` (and to the router's, the
planner's and the benchmarks' commands)."""
