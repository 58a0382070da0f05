"""Build frozen config dataclasses from plain mappings (JSON, TOML, flags).

``from_mapping(Config, {"path": "/x", "capacity_bytes": "10GiB"}, "l2 'fs'")``
checks every key against the dataclass's fields, converts sizes written as
text for fields whose name ends in ``_bytes``, checks types, and raises
ValueError naming the option to change.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from kvtier.units import parse_size

C = TypeVar("C")


def from_mapping(cls: type[C], data: Mapping[str, Any], where: str) -> C:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected an object of options, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown option {unknown[0]!r}; known options: {sorted(fields)}")
    missing = [
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing required option {missing[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {name: _convert(value, name, hints[name], where) for name, value in data.items()}
    try:
        return cls(**values)
    except ValueError as exc:  # the config's own validation
        raise ValueError(f"{where}: {exc}") from None


def _convert(value: Any, name: str, hint: Any, where: str) -> Any:
    if name.endswith("_bytes") and isinstance(value, str):
        return parse_size(value, f"{where}: option {name!r}")
    if typing.get_origin(hint) in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: option {name!r} must be a list, got {value!r}")
        return tuple(value)
    allowed = typing.get_args(hint) or (hint,)
    if typing.get_origin(hint) is typing.Literal:
        if value not in allowed:
            raise ValueError(
                f"{where}: option {name!r} must be one of {list(allowed)}, got {value!r}"
            )
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    types = tuple(t for t in allowed if isinstance(t, type))
    wrong_bool = isinstance(value, bool) and bool not in types
    if types and (wrong_bool or not isinstance(value, types)):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{where}: option {name!r} must be {names}, got {value!r}")
    return value
