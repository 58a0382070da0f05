"""``KeySelector``: which objects an operator's purge or retention names.

Object keys carry the model and salt labels in their string form
(``{model}@{salt}@r{rank}g{group}@{hash}``), so every tier can find a
namespace's objects by those two labels: a selector names a model (every
salt), a salt (every model: one tenant's namespace), or both. Revision and
layout are inside the chunk hash, not in the key: a new revision is a new
namespace that old objects never hit, and retention removes those by age.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.keys.label import SEP, NamespaceLabel, given_salt_label, is_salt_label, model_label
from kvtier.keys.object_key import ObjectKey


@dataclass(frozen=True, slots=True)
class KeySelector:
    model: str | None = None  # a model label; None: every model
    salt: str | None = None  # a salt label ("" is a salt too); None: every salt

    def __post_init__(self) -> None:
        if self.model is None and self.salt is None:
            raise ValueError("a selector names a model, a salt or both, never everything")
        if self.model is not None and self.model != model_label(self.model):
            raise ValueError(f"selector model {self.model!r} is not a key label; use model_label")
        # Not ``salt != salt_label(salt)``: a hashed label (``s-`` and hex) is
        # not its own label, and it is what a tenant's odd salt is keyed by.
        if self.salt is not None and not is_salt_label(self.salt):
            raise ValueError(
                f"selector salt {self.salt!r} is not a key label; use given_salt_label"
            )

    @classmethod
    def of(cls, model: str | None = None, salt: str | None = None) -> KeySelector:
        """From names as users give them (a hub id; a salt as the tenants
        file spells it, or its label: ``given_salt_label``)."""
        return cls(
            None if model is None else model_label(model),
            None if salt is None else given_salt_label(salt),
        )

    def matches(self, key: ObjectKey) -> bool:
        return (self.model is None or key.model == self.model) and (
            self.salt is None or key.salt == self.salt
        )

    @property
    def prefix(self) -> str:
        """The key-string prefix every match starts with ("" without a model)."""
        if self.model is None:
            return ""
        if self.salt is None:
            return f"{self.model}{SEP}"
        return f"{NamespaceLabel(self.model, self.salt)}{SEP}"

    def glob(self) -> str:
        """A glob over key strings (Redis MATCH); labels hold no glob characters."""
        return f"{self.name()}{SEP}*"

    def regex(self, prefix: str = "") -> str:
        """An anchored regular expression over ``prefix`` + key strings (a
        store's own names, e.g. Mooncake's ``remove_by_regex``)."""
        any_label = f"[^{SEP}]*"
        model = any_label if self.model is None else _escape(self.model)
        salt = any_label if self.salt is None else _escape(self.salt)
        return f"^{_escape(prefix)}{model}{SEP}{salt}{SEP}.*$"

    def name(self) -> str:
        """The text form of the namespace named (``NamespaceLabel``), with
        ``*`` for a label left open: ``m@*``, ``*@s``."""
        model = "*" if self.model is None else self.model
        salt = "*" if self.salt is None else self.salt
        return f"{model}{SEP}{salt}"


def _escape(text: str) -> str:
    """Backslashes before regex syntax characters only (``re.escape`` also
    escapes ``-``, which ECMAScript engines such as C++'s may refuse)."""
    return _SPECIAL.sub(r"\\\g<0>", text)


_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}]")

__all__ = ["KeySelector"]
