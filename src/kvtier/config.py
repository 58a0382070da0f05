"""One configuration model for every entry point.

Each component's settings are a frozen dataclass, validated once when it is
built (``L1Config``, ``StoreConfig``, ``PrefetchConfig``, ``ServerLimits``,
the L2 adapters' configs; ``ServerConfig`` nests the server's;
``ConnectorSettings``; ``BenchOptions``). ``load`` builds one from layers of
plain mappings, with one precedence everywhere::

    flags  >  environment  >  file  >  defaults

A layer sets only the keys it has. A field whose type is itself a settings
dataclass is a section: a TOML table (``[l1]``), environment variables named
``{PREFIX}{SECTION}_{FIELD}`` (``KVTIER_L1_EVICTION_POLICY``), a dotted flag
key (``--set l1.eviction_policy=gdsf``). Sizes (``*_bytes``) may be text
(``"8GiB"``); their environment variables drop the ``_BYTES``
(``KVTIER_L1_SIZE``). Errors name where the value came from: the flag, the
variable, or the key in the file.

``from_mapping`` is the last step, and the one adapters use for their specs:
it checks every key against the dataclass's fields, converts sizes and
types, and raises ValueError naming the option to change.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import tomli_w

from kvtier.units import parse_size

C = TypeVar("C")
Layer = dict[str, Any]
Namer = Callable[[str], str]  # a dotted key -> how the user spelled it (for errors)
SECRET_FIELDS = (
    "auth_token",
    "cluster_secret",
    "secret_access_key",
)  # never printed; kvtier serve: no flag
URL_FIELDS = ("url",)  # printed without their password


def redacted(url: str) -> str:
    """The URL without its password (for status and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def load(
    cls: type[C],
    *,
    file: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    env_prefix: str = "KVTIER_",
    where: str = "",
    flag_name: Namer | None = None,
    defaults: C | None = None,
) -> C:
    """Build ``cls`` from the layers (see the module docstring). ``flags`` is
    a nested or dotted mapping of the values given (None: not given);
    ``environ`` defaults to ``os.environ``; ``defaults``, an instance whose
    values are the bottom layer (else the dataclass's own defaults)."""
    base = as_layer(defaults) if defaults is not None else {}
    layers = [
        base,
        _checked(cls, nested(file or {}), lambda key: f"{key} in {where or 'the file'}"),
        env_layer(cls, os.environ if environ is None else environ, env_prefix),
        _checked(cls, nested({k: v for k, v in (flags or {}).items() if v is not None}), flag_name),
    ]
    merged: Layer = {}
    for layer in layers:
        merge_into(merged, layer)
    return from_mapping(cls, merged, where or cls.__name__)


def secret(path: str | None, flag: str, variable: str) -> str:
    """A secret from the file a flag names (``secret_file``), else the
    environment variable, else "" (never from a flag's value: a command line
    shows in ``ps``)."""
    if path:
        return secret_file(path, flag)
    return os.environ.get(variable, "")


def secret_file(path: str | Path, flag: str) -> str:
    """The text of a secret file, stripped: how kvtier's secret and token
    file options are read. ValueError naming ``flag``, the file and the fix
    when it cannot be read, is not UTF-8 text, or is not private.

    Private, as ssh wants a private key: others may not read or write it, nor
    its group when it is ours (``chmod 600``). The mode checked is that of the
    file read, a symlink followed, as Kubernetes mounts secrets. A file that
    someone else owns may be read by its group: that is how one reaches us
    when another user (root) grants it, as Kubernetes does with ``fsGroup``,
    which turns ``defaultMode: 0400`` into 0440."""
    try:
        with open(path, "rb") as file:
            _check_private(os.fstat(file.fileno()), path, flag)
            data = file.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{flag} {path}: not text (byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"is not UTF-8); write the secret as text, e.g. openssl rand -hex 32 > {path}"
        ) from None


def _check_private(st: os.stat_result, path: str | Path, flag: str) -> None:
    shared = st.st_mode & 0o077
    if st.st_uid != os.geteuid():
        shared &= ~0o040  # its group may read a file someone else owns (see secret_file)
    if shared:
        raise ValueError(
            f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
            f"{'others' if shared & 0o007 else 'its group'} use this secret file; "
            f"make it private: chmod 600 {path} (a Kubernetes secret volume: defaultMode: 0400)"
        )


def read_toml(path: str | Path, what: str) -> Layer:
    """A TOML file as a layer; ValueError naming ``what`` (the flag) if unreadable."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{what} {path}: {exc}") from None


def dump_toml(config: object) -> str:
    """``config`` as TOML that ``load`` reads back, secrets masked."""
    return tomli_w.dumps(_plain(as_layer(config)))


def as_layer(config: object) -> Layer:
    """A settings dataclass as a nested mapping of its fields."""
    return {
        f.name: as_layer(value) if dataclasses.is_dataclass(value) else value
        for f in dataclasses.fields(config)  # type: ignore[arg-type]
        if f.init
        for value in (getattr(config, f.name),)
    }


def nested(data: Mapping[str, Any]) -> Layer:
    """``{"l1.size_bytes": 1}`` -> ``{"l1": {"size_bytes": 1}}`` (nested keys kept)."""
    out: Layer = {}
    for key, value in data.items():
        *sections, name = key.split(".")
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        if isinstance(value, Mapping) and isinstance(target.get(name), dict):
            merge_into(target[name], nested(value))
        else:
            target[name] = nested(value) if isinstance(value, Mapping) else value
    return out


def merge_into(target: Layer, layer: Mapping[str, Any]) -> None:
    """Deep-merge ``layer`` over ``target`` (sections merge, values replace)."""
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_into(target[key], value)
        else:
            target[key] = dict(value) if isinstance(value, Mapping) else value


def env_name(prefix: str, key: str) -> str:
    """``("KVTIER_", "l1.size_bytes")`` -> ``KVTIER_L1_SIZE``."""
    return prefix + key.replace(".", "_").upper().removesuffix("_BYTES")


def env_layer(cls: type[Any], environ: Mapping[str, str], prefix: str, section: str = "") -> Layer:
    """The values ``environ`` sets for ``cls``'s fields, converted from text."""
    layer: Layer = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{section}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            sub = env_layer(hint, environ, prefix, key + ".")  # type: ignore[arg-type]
            if sub:
                layer[f.name] = sub
            continue
        name = env_name(prefix, key)
        if name in environ:
            layer[f.name] = _from_text(environ[name], f.name, hint, name)
    return layer


def from_mapping(cls: type[C], data: Mapping[str, Any], where: str) -> C:
    """Build ``cls`` (and its sections) from ``data``; ValueError naming the option."""
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
    values = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            values[name] = from_mapping(hint, value, f"{where} [{name}]")  # type: ignore[arg-type]
        else:
            values[name] = _convert(value, name, hint, f"{where}: option {name!r}")
    try:
        return cls(**values)
    except ValueError as exc:  # the config's own validation
        raise ValueError(f"{where}: {exc}") from None


# ---------------------------------------------------------------- internals


def _checked(cls: type[Any], layer: Layer, namer: Namer | None, section: str = "") -> Layer:
    """Convert a layer's values to their fields' types, naming the source in errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    out: Layer = {}
    for name, value in layer.items():
        key = f"{section}{name}"
        if name not in fields:
            shown = namer(key) if namer else key
            raise ValueError(f"unknown option {shown}; known: {sorted(fields)}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                shown = namer(key) if namer else key
                raise ValueError(f"{shown} must be a table of options, got {value!r}")
            out[name] = _checked(hint, dict(value), namer, key + ".")  # type: ignore[arg-type]
        else:
            out[name] = _convert(value, name, hint, namer(key) if namer else key)
    return out


def _from_text(value: str, name: str, hint: Any, where: str) -> Any:
    """An environment variable's text as the field's type."""
    allowed = typing.get_args(hint) or (hint,)
    if name.endswith("_bytes") or str in allowed:
        return _convert(value, name, hint, where)
    if bool in allowed:
        lowered = value.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return lowered in ("1", "true", "yes", "on")
    for kind in (int, float):
        if kind in allowed:
            try:
                return kind(value)
            except ValueError:
                raise ValueError(f"{where} must be {kind.__name__}, got {value!r}") from None
    return value


def _convert(value: Any, name: str, hint: Any, where: str) -> Any:
    optional = type(None) in typing.get_args(hint)
    if value is None and optional:
        return None
    if name.endswith("_bytes") and isinstance(value, str):
        return parse_size(value, where)
    if optional:  # X | None with a value: check it as an X
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            hint = inner[0]
    if typing.get_origin(hint) in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return dict(value)
    if typing.get_origin(hint) in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return tuple(value)
    allowed = typing.get_args(hint) or (hint,)
    if typing.get_origin(hint) is typing.Literal:
        if value not in allowed:
            raise ValueError(f"{where} must be one of {list(allowed)}, got {value!r}")
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    types = tuple(t for t in allowed if isinstance(t, type))
    wrong_bool = isinstance(value, bool) and bool not in types
    if types and (wrong_bool or not isinstance(value, types)):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{where} must be {names}, got {value!r}")
    return value


def _plain(layer: Mapping[str, Any]) -> Layer:
    """A layer TOML can hold: secrets masked, None and empty sections left out."""
    out: Layer = {}
    for key, value in layer.items():
        if key in SECRET_FIELDS and value:
            out[key] = "***"
        elif key in URL_FIELDS and isinstance(value, str):
            out[key] = redacted(value)
        elif isinstance(value, Mapping):
            out[key] = _plain(value)
        elif isinstance(value, tuple | list):
            out[key] = [_plain(v) if isinstance(v, Mapping) else v for v in value]
        elif value is not None:
            out[key] = value
    return out
