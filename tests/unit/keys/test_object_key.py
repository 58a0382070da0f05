from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import ObjectKey, chunk_keys, model_label, salt_label

HASH = bytes(range(32))
SAFE = st.text(alphabet="abcXYZ019._-", max_size=20)


@given(
    chunk_hash=st.binary(min_size=32, max_size=32),
    model=SAFE.filter(bool),
    rank=st.integers(0, 65535),
    group=st.integers(0, 65535),
    salt=SAFE,
)
def test_string_form_round_trips(
    chunk_hash: bytes, model: str, rank: int, group: int, salt: str
) -> None:
    key = ObjectKey(chunk_hash, model, rank, group, salt)
    text = key.to_str()
    assert ObjectKey.from_str(text) == key
    assert "/" not in text and "\\" not in text and "\x00" not in text


def test_string_form_is_exact() -> None:
    key = ObjectKey(HASH, "org--llama", kv_rank=3, group=1, salt="tenant-a")
    assert key.to_str() == "org--llama@tenant-a@r3g1@" + HASH.hex()


def test_frozen_and_hashable() -> None:
    a, b = ObjectKey(HASH, "m", 0), ObjectKey(HASH, "m", 0)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert ObjectKey(HASH, "m", 1) != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kv_rank = 2  # type: ignore[misc]


def test_model_label_makes_hub_ids_safe() -> None:
    assert model_label("meta-llama/Llama-3.1-8B") == "meta-llama--Llama-3.1-8B"
    ObjectKey(HASH, model_label("Qwen/Qwen2.5-7B-Instruct"), 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_hash": b"short"}, "5 bytes"),
        ({"chunk_hash": "00" * 32}, "must be bytes"),
        ({"model": ""}, "must not be empty"),
        ({"model": "org/name"}, "model_label"),
        ({"model": "a\\b"}, "path separators"),
        ({"model": "a\x00b"}, "NUL"),
        ({"model": "a@b"}, "'@'"),
        ({"model": "m" * 129}, "limit is 128"),
        ({"salt": "x/y"}, "ObjectKey.salt"),
        ({"salt": "s" * 65}, "limit is 64"),
        ({"kv_rank": -1}, "kv_rank is -1"),
        ({"kv_rank": 1 << 16}, "kv_rank"),
        ({"group": -2}, "group is -2"),
        ({"kv_rank": True}, "must be an int"),
        ({"kv_rank": 1.0}, "must be an int"),
    ],
)
def test_invalid_fields_raise_clear_errors(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"chunk_hash": HASH, "model": "m", "kv_rank": 0, **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        ObjectKey(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("m@@r0g0", "4 '@'-separated parts"),
        ("m@@x0g0@" + HASH.hex(), "r0g0"),
        ("m@@r0g0@" + HASH.hex().upper(), "hex digits"),
        ("m@@r0g0@" + HASH.hex()[:-2], "hex digits"),
        ("m@@r00g0@" + HASH.hex(), "canonical"),
        ("a/b@@r0g0@" + HASH.hex(), "model_label"),
    ],
)
def test_from_str_rejects_malformed_keys(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectKey.from_str(text)


def test_chunk_keys_equal_validated_keys() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    fast = chunk_keys(hashes, "org--m", ranks=2, group=1, salt="t")
    slow = [[ObjectKey(h, "org--m", r, 1, "t") for r in range(2)] for h in hashes]
    assert fast == slow
    assert [[hash(k) for k in row] for row in fast] == [[hash(k) for k in row] for row in slow]
    assert [[k.to_str() for k in row] for row in fast] == [
        [k.to_str() for k in row] for row in slow
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hashes": [b"x" * 31]}, "31 bytes"),
        ({"model": "a/b"}, "model_label"),
        ({"salt": "x@y"}, "ObjectKey.salt"),
        ({"group": -1}, "group is -1"),
    ],
)
def test_chunk_keys_validate_their_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"hashes": [bytes(32)], "model": "m", "ranks": 1, **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        chunk_keys(**args)  # type: ignore[arg-type]


def test_salt_labels_keep_safe_salts_and_hash_the_rest() -> None:
    assert salt_label("tenant_1.a-b") == "tenant_1.a-b"
    hashed = salt_label("tenant/with spaces")
    assert hashed.startswith("s-") and len(hashed) == 34
    assert hashed != salt_label("tenant/with  spaces")  # distinct salts stay distinct
    assert salt_label("x" * 65) != salt_label("x" * 66)
    assert salt_label("alice@example.com") == salt_label("alice@example.com")
    ObjectKey(HASH, "m", 0, 0, salt_label("alice@example.com"))  # always a valid salt


def test_a_salt_shaped_like_a_label_does_not_meet_the_salt_it_labels() -> None:
    """The adversarial run's finding: "acme corp" and the literal salt
    "s-" + its hash used to get the same label, so the two tenants shared KV."""
    label = salt_label("acme corp")
    assert salt_label(label) != label
    assert salt_label("s-" + "0" * 32).startswith("s-")
    assert salt_label("s-" + "0" * 31) == "s-" + "0" * 31  # not the label form: kept


SALTS = st.one_of(st.text(max_size=80), st.text(max_size=80).map(salt_label))  # labels too


@given(SALTS, SALTS)
def test_distinct_salts_get_distinct_labels(a: str, b: str) -> None:
    if a != b:
        assert salt_label(a) != salt_label(b)


def test_a_model_label_is_its_own_label() -> None:
    """Engines send labels and the server labels what it is sent: a hashed
    label must come through unchanged, or server keys differ from local ones."""
    for name in ("meta-llama/Llama-3.1-8B", "/models/my model+lora", "x" * 300):
        label = model_label(name)
        assert model_label(label) == label
