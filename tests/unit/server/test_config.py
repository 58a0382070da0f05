from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.server.config import ServerConfig, default_l1_bytes, env_name, load_config


def test_defaults_work_without_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ServerConfig.__dataclass_fields__:
        monkeypatch.delenv(env_name(name), raising=False)
    config = load_config({})
    assert config.host == "127.0.0.1" and config.port == 5555 and config.chunk_size == 256
    assert config.l1_bytes == default_l1_bytes()
    assert 256 << 20 <= config.l1_bytes <= 16 << 30
    assert config.l2_dir is not None and config.l2_dir.endswith("kvtier/l2")


def test_flags_beat_environment_beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text('port = 7000\nchunk_size = 512\nl1_size_bytes = "1GiB"\nauth_token = "file"\n')
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "1024")
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "env")
    monkeypatch.setenv("KVTIER_L1_SIZE", "2GiB")
    config = load_config({"auth_token": "flag", "port": None}, str(toml))
    assert config.port == 7000  # file (the flag was not given)
    assert config.chunk_size == 1024  # environment over file
    assert config.l1_size_bytes == 2 << 30
    assert config.auth_token == "flag"  # flag over environment


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"port": 70000}, "--port 70000"),
        ({"http_port": -5}, "--http-port"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"l1_size_bytes": "lots"}, "--l1-size: cannot read 'lots' as a size"),
        ({"session_ttl_s": "soon"}, "--session-ttl-s must be float"),
        ({"bogus": 1}, "unknown option 'bogus'"),
    ],
)
def test_bad_settings_name_what_to_change(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(flags)


def test_bad_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ValueError, match="--config"):
        load_config({}, str(bad))
    with pytest.raises(ValueError, match="--config"):
        load_config({}, str(tmp_path / "missing.toml"))


def test_cache_dir_none_turns_l2_off() -> None:
    assert ServerConfig(cache_dir="none").l2_dir is None
