"""The SGLang backend's settings (``kvtier.engine.sglang.settings``), which
load without SGLang: every key checked, errors naming the key, the token
from a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.sglang.settings import BackendSettings

ADDRESS = {"address": "tcp://127.0.0.1:5555"}


def test_the_keys_are_read_and_the_model_defaults_to_sglangs() -> None:
    extra = {**ADDRESS, "salt": "team-a", "revision": "r1", "request_timeout_s": 5, "x": 1}
    settings = BackendSettings.from_extra_config(extra, "Qwen/Qwen2.5-7B")
    assert settings == BackendSettings(
        "tcp://127.0.0.1:5555", "team-a", "Qwen/Qwen2.5-7B", "r1", "", 5.0
    )


@pytest.mark.parametrize(
    ("extra", "model", "says"),
    [
        ({}, "m", "'address' must name the cache server"),
        ({"address": "127.0.0.1:5555"}, "m", "'address' must name the cache server"),
        ({**ADDRESS, "salt": 3}, "m", "'salt' must be a string"),
        (ADDRESS, None, "'model' is required"),
        ({**ADDRESS, "request_timeout_s": 0}, "m", "'request_timeout_s' must be a positive"),
        ({**ADDRESS, "request_timeout_s": True}, "m", "'request_timeout_s' must be a positive"),
        ({**ADDRESS, "auth_token": "t", "auth_token_file": "f"}, "m", "not both"),
        ({**ADDRESS, "auth_token_file": "/no/such/file"}, "m", "'auth_token_file'"),
    ],
)
def test_a_bad_key_is_refused_by_name(extra: dict[str, Any], model: str | None, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        BackendSettings.from_extra_config(extra, model)


def test_the_token_comes_from_its_file_which_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    extra = {**ADDRESS, "auth_token_file": str(path)}
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        BackendSettings.from_extra_config(extra, "m")
    path.chmod(0o600)
    assert BackendSettings.from_extra_config(extra, "m").auth_token == "s3cret"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        BackendSettings.from_extra_config(extra, "m")
