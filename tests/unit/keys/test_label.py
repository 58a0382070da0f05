"""``NamespaceLabel``: one value and one text form for a namespace's model
and salt labels; and ``key_namespace``, the one place a salt is labelled for
hashing."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import (
    Namespace,
    NamespaceLabel,
    ObjectKey,
    key_namespace,
    model_label,
    salt_label,
)
from kvtier.server.sessions import Client

LABEL = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=20)


@given(model=LABEL, salt=st.one_of(st.just(""), LABEL))
def test_the_text_form_round_trips(model: str, salt: str) -> None:
    label = NamespaceLabel(model, salt)
    assert str(label) == f"{model}@{salt}"
    assert NamespaceLabel.parse(str(label)) == label
    assert f"{label}" == str(label)  # as JSON and log lines format it


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("llama", "must be 'model@salt'"),
        ("llama@acme@r0g0", "must be 'model@salt'"),
        ("@acme", "NamespaceLabel.model must not be empty"),
        ("org/llama@acme", "NamespaceLabel.model 'org/llama' may only use"),
        ("llama@acme corp", "NamespaceLabel.salt 'acme corp' may only use"),
        ("llama@" + "s" * 65, "NamespaceLabel.salt is 65 characters; the limit is 64"),
        ("m" * 129 + "@", "NamespaceLabel.model is 129 characters; the limit is 128"),
    ],
)
def test_parse_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        NamespaceLabel.parse(text)
    assert repr(text)[:20] in str(raised.value)  # the text it was given


def test_labels_are_checked_and_frozen() -> None:
    with pytest.raises(TypeError, match=r"NamespaceLabel\.salt must be a str"):
        NamespaceLabel("m", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a namespace is a str"):
        NamespaceLabel.parse(b"m@s")  # type: ignore[arg-type]
    label = NamespaceLabel("m", "s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        label.salt = "t"  # type: ignore[misc]
    assert {label: 1}[NamespaceLabel("m", "s")] == 1
    assert NamespaceLabel("m") == NamespaceLabel("m", "")


def test_labels_order_by_model_then_salt() -> None:
    """Not the order of the text forms: '-' sorts before '@'."""
    labels = [NamespaceLabel("m", "b"), NamespaceLabel("m-x", ""), NamespaceLabel("m", "a")]
    assert sorted(labels) == [labels[2], labels[0], labels[1]]
    assert sorted(map(str, labels)) == ["m-x@", "m@a", "m@b"]


def test_the_constructors_label_names_once() -> None:
    assert NamespaceLabel.named("org/llama", "acme corp") == NamespaceLabel(
        "org--llama", salt_label("acme corp")
    )
    hashed = salt_label("acme corp")
    assert NamespaceLabel.named("m", hashed).salt == salt_label(hashed) != hashed
    assert NamespaceLabel.given("org/llama", hashed) == NamespaceLabel("org--llama", hashed)
    assert NamespaceLabel.given("m", "acme corp").salt == hashed


def test_a_key_and_a_client_name_their_namespace() -> None:
    key = ObjectKey(bytes(32), "org--llama", 3, 1, "acme")
    assert NamespaceLabel.of_key(key) == NamespaceLabel("org--llama", "acme")
    assert hash(NamespaceLabel.of_key(key)) == hash(NamespaceLabel("org--llama", "acme"))
    assert key.to_str().startswith(f"{NamespaceLabel.of_key(key)}@")
    client = Client(b"peer", "c0", "client", "org--llama", "acme", {}, 1, False)
    assert NamespaceLabel.of(client) == NamespaceLabel.of_key(key)
    assert client.namespace == NamespaceLabel.of_key(key)  # made once, when it said hello
    with pytest.raises(ValueError, match=r"NamespaceLabel\.salt"):
        Client(b"peer", "c0", "client", "org--llama", "acme corp", {}, 1, False)
    client.salt = "acme corp"  # never accepted at HELLO: a client's labels are checked there
    with pytest.raises(ValueError, match=r"NamespaceLabel\.salt"):
        NamespaceLabel.of(client)


@pytest.mark.parametrize("salt", ["", "acme", "acme corp", "team/a", "s-" + "0" * 32])
def test_key_namespace_labels_the_salt_once(salt: str) -> None:
    namespace = key_namespace("org/llama", revision="r", kv_dtype="bfloat16", salt=salt)
    assert namespace == Namespace(
        "org/llama", revision="r", kv_dtype="bfloat16", salt=salt_label(salt)
    )
    assert namespace.model == "org/llama" != model_label("org/llama")  # the full name is hashed
    assert namespace.salt == NamespaceLabel.named("org/llama", salt).salt


@pytest.mark.parametrize("salt", ["acme corp", "team/a", "x" * 65])
def test_a_namespace_refuses_a_salt_nobody_labelled(salt: str) -> None:
    message = r"Namespace\.salt .* is not a salt label; .*key_namespace"
    with pytest.raises(ValueError, match=message):
        Namespace("m", salt=salt)
