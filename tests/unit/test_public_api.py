"""``kvtier.__all__`` is the public API: every name resolves to what its home
module defines, and ``import kvtier`` alone loads none of it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import kvtier

NEEDS = {"KVTierConnector": "vllm", "KVTierModel": "transformers"}


@pytest.mark.parametrize("name", [n for n in kvtier.__all__ if n != "__version__"])
def test_each_public_name_resolves(name: str) -> None:
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{name} needs {NEEDS[name]}")
    value = getattr(kvtier, name)
    assert value.__name__ == name and value.__module__.startswith("kvtier.")


def test_importing_kvtier_loads_nothing_heavy() -> None:
    code = (
        "import sys, kvtier\n"
        "print(sorted(m for m in ('numpy', 'zmq', 'torch', 'kvtier.storage') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'CacheServer'"):
        kvtier.CacheServer  # noqa: B018
