"""Key labels: the model and salt labels every object key carries, and
``NamespaceLabel``, the pair of them that names one namespace.

A label may use only ``[A-Za-z0-9._-]`` (a safe file name and remote key: no
path separators, no NUL, no ``@``). Engines and operators give names;
labels are made from them here, once:

- ``model_label``: a Hugging Face id ``org/name`` becomes ``org--name``;
  a name still not key-safe is hashed. A model label is its own label.
- ``salt_label``: a tenant salt that is key-safe is kept, anything else is
  hashed. A salt label is *not* its own label (a hashed label is hashed
  again), so it is applied once, to the salt as the tenant gave it: by
  ``key_namespace`` for the chunk hashes and by ``NamespaceLabel.named``
  for the keys.
- ``given_salt_label``: an operator's salt, which may already be a label.

``NamespaceLabel`` has one text form, ``model@salt`` (``str()``), which
``parse`` reads back; it is the ``namespace`` that ``/status``, the admin API,
the ledger and the dashboard show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from blake3 import blake3

MAX_MODEL_CHARS = 128
MAX_SALT_CHARS = 64
SEP = "@"  # between the labels of a namespace, and the parts of an object key
SAFE = re.compile(r"[A-Za-z0-9._-]*")
_HASHED_SALT = re.compile(r"s-[0-9a-f]{32}")


def model_label(model: str) -> str:
    """A model name made safe for ``ObjectKey.model``: ``/`` becomes ``--``
    (the Hugging Face cache's convention); a name that is still too long or
    not key-safe (a local path with a space or a ``+``) becomes ``m-`` and 32
    hex digits of its blake3. A label is its own label (engines send labels,
    and the server labels what it is sent), so two labels may coincide: the
    label is for people and listings, the chunk hash covers the full name."""
    label = model.replace("/", "--")
    if 0 < len(label) <= MAX_MODEL_CHARS and SAFE.fullmatch(label):
        return label
    return "m-" + blake3(model.encode()).hexdigest(length=16)


def salt_label(salt: str) -> str:
    """A tenant salt made safe for ``ObjectKey.salt``: kept when it already is
    safe, else ``s-`` and 32 hex digits of its blake3. A safe salt that has
    that very form is hashed too, so a kept salt never looks like a hashed
    one and distinct salts always get distinct labels (short of a blake3
    collision). Apply it once: a label is not a fixed point."""
    if len(salt) <= MAX_SALT_CHARS and SAFE.fullmatch(salt) and not _HASHED_SALT.fullmatch(salt):
        return salt
    return "s-" + blake3(salt.encode()).hexdigest(length=16)


def is_salt_label(text: str) -> bool:
    """Whether ``text`` can be an ``ObjectKey.salt``: ``salt_label``'s
    answer for some salt (a kept safe salt, or ``s-`` and 32 hex digits)."""
    return len(text) <= MAX_SALT_CHARS and SAFE.fullmatch(text) is not None


def given_salt_label(salt: str) -> str:
    """The label of a salt as an operator names it: a salt label (as
    listings show it) is kept, anything else is labelled (``salt_label``),
    so both the label and a tenants file's own spelling name one namespace.
    A salt that has itself the form ``s-`` and 32 hex digits is read as a
    label: name such a salt's namespace by its label or by its tenant."""
    return salt if is_salt_label(salt) else salt_label(salt)


def check_label(field: str, value: object, limit: int, *, empty_ok: bool) -> None:
    """TypeError or ValueError naming ``field`` unless ``value`` is a key
    label of at most ``limit`` characters (empty only if ``empty_ok``)."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"{field} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{field} is {len(value)} characters; the limit is {limit}")
    if SAFE.fullmatch(value) is None:
        raise ValueError(
            f"{field} {value!r} may only use letters, digits, '.', '_' and '-' "
            "(no path separators, NUL or '@'); for a model id use model_label()"
        )


class Labelled(Protocol):
    """Anything that carries a model label and a salt label (a registered
    client of the cache server, for one)."""

    @property
    def model(self) -> str: ...

    @property
    def salt(self) -> str: ...


@dataclass(frozen=True, slots=True, order=True)
class NamespaceLabel:
    """One namespace as keys name it: a model label and a salt label
    (``""``: no salt). Frozen, hashable, validated; ordered by model, then
    salt (which is not always the order of the text forms: sort by ``str``
    where a listing must keep the text order). ``str()`` is the one text
    form, ``model@salt``."""

    model: str
    salt: str = ""

    def __post_init__(self) -> None:
        check_label("NamespaceLabel.model", self.model, MAX_MODEL_CHARS, empty_ok=False)
        check_label("NamespaceLabel.salt", self.salt, MAX_SALT_CHARS, empty_ok=True)

    def __str__(self) -> str:
        return f"{self.model}{SEP}{self.salt}"

    @classmethod
    def parse(cls, text: str) -> NamespaceLabel:
        """Read ``str()``'s form back; ValueError saying what is wrong."""
        if not isinstance(text, str):
            raise TypeError(f"a namespace is a str 'model@salt', got {type(text).__name__}")
        model, sep, salt = text.partition(SEP)
        if not sep or SEP in salt:
            raise ValueError(f"namespace {text!r} must be 'model@salt': one '@' between two labels")
        try:
            return cls(model, salt)
        except ValueError as exc:
            raise ValueError(f"namespace {text!r}: {exc}") from None

    @classmethod
    def named(cls, model: str, salt: str = "") -> NamespaceLabel:
        """From the names an engine is given: a model name or hub id and the
        tenant's salt as the tenant spells it (each labelled here, once)."""
        return cls(model_label(model), salt_label(salt))

    @classmethod
    def given(cls, model: str, salt: str = "") -> NamespaceLabel:
        """From the names an operator gives: a model name or label, and a
        salt or its label (``given_salt_label``)."""
        return cls(model_label(model), given_salt_label(salt))

    @classmethod
    def of(cls, named: Labelled) -> NamespaceLabel:
        """The namespace of anything with ``model`` and ``salt`` labels (a
        registered client); ValueError if they are not labels."""
        return cls(named.model, named.salt)

    @classmethod
    def of_key(cls, key: Labelled) -> NamespaceLabel:
        """The namespace of an object key (an ``ObjectKey``). Its labels were
        checked when the key was made, so they are not checked again (listings build one per
        resident object)."""
        label = object.__new__(cls)
        object.__setattr__(label, "model", key.model)
        object.__setattr__(label, "salt", key.salt)
        return label


__all__ = [
    "MAX_MODEL_CHARS",
    "MAX_SALT_CHARS",
    "SEP",
    "Labelled",
    "NamespaceLabel",
    "check_label",
    "given_salt_label",
    "is_salt_label",
    "model_label",
    "salt_label",
]
