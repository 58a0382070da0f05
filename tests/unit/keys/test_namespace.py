from __future__ import annotations

import pytest

from kvtier.keys import Namespace


def test_defaults_are_empty_strings() -> None:
    ns = Namespace("m")
    assert (ns.revision, ns.lora, ns.kv_dtype, ns.layout, ns.salt) == ("",) * 5


def test_model_is_required_and_fields_are_strings() -> None:
    with pytest.raises(ValueError, match=r"Namespace\.model must not be empty"):
        Namespace("")
    with pytest.raises(TypeError, match=r"Namespace\.revision must be a str"):
        Namespace("m", revision=3)  # type: ignore[arg-type]
