"""The README's commands and example stay true."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_opens_with_install_run_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert first_block is not None
    lines = [line.split("#")[0].strip() for line in first_block[1].strip().splitlines()]
    assert lines[0] == "pip install . && kvtier selfcheck"
    assert lines[1] == 'pip install -e ".[test]" && python -m pytest -q'


def test_python_example_runs() -> None:
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert example is not None
    exec(compile(example[1], str(README), "exec"), {})
