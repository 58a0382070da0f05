from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.commands.cli import main
from kvtier.config import dump_toml
from kvtier.server.config import ServerConfig, default_l1_bytes, flag_name, load_config

NO_ENV: dict[str, str] = {}


def write_secret(path: Path, data: str | bytes, mode: int = 0o600) -> Path:
    """A secret file as an operator writes one: private (0600) unless ``mode`` says."""
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def test_defaults_work_without_configuration() -> None:
    config = load_config({}, environ=NO_ENV)
    assert config.host == "127.0.0.1" and config.port == 5555 and config.chunk_size == 256
    assert config.l1.size_bytes == default_l1_bytes()
    assert 256 << 20 <= config.l1.size_bytes <= 16 << 30
    assert config.l2_dir is not None and config.l2_dir.endswith("kvtier/l2")
    assert config.store.policy == "all" and config.l1.eviction_policy == "lru"


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text(
        'port = 7000\nchunk_size = 512\nauth_token = "file"\n'
        '[l1]\nsize_bytes = "1GiB"\neviction_policy = "gdsf"\nhigh_watermark = 0.9\n'
        '[store]\npolicy = "hit_count>=2"\n'
        "[limits]\nclient_ttl_s = 7\n"
    )
    environ = {
        "KVTIER_CHUNK_SIZE": "1024",
        "KVTIER_AUTH_TOKEN": "env",
        "KVTIER_L1_SIZE": "2GiB",
        "KVTIER_LIMITS_CLIENT_TTL_S": "9",
    }
    flags = {"port": None, "l1.eviction_policy": "lru", "store.policy": None}
    config = load_config(flags, str(toml), environ)
    assert config.port == 7000  # file (the flag was not given)
    assert config.chunk_size == 1024  # environment over file
    assert config.l1.size_bytes == 2 << 30
    assert config.l1.eviction_policy == "lru"  # flag over file
    assert config.l1.high_watermark == 0.9  # file, the rest of its section kept
    assert config.store.policy == "hit_count>=2"
    assert config.limits.client_ttl_s == 9.0
    assert config.auth_token == "env"


def test_the_token_comes_from_a_file_not_a_flag(tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "token", "s3cret\n")
    config = load_config({"auth_token_file": str(secret)}, environ=NO_ENV)
    assert config.auth_token == "s3cret"
    with pytest.raises(ValueError, match=r"--auth-token-file .*missing"):
        load_config({"auth_token_file": str(tmp_path / "missing")}, environ=NO_ENV)


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({"port": 70000}, {}, "--port 70000"),
        ({"http_port": -5}, {}, "--http-port"),
        ({"chunk_size": 0}, {}, "--chunk-size"),
        ({"l1.size_bytes": "lots"}, {}, "--l1-size: cannot read 'lots' as a size"),
        ({}, {"KVTIER_L1_SIZE": "lots"}, "KVTIER_L1_SIZE: cannot read 'lots'"),
        ({}, {"KVTIER_LIMITS_SESSION_TTL_S": "soon"}, "KVTIER_LIMITS_SESSION_TTL_S must be float"),
        ({"l1.eviction_policy": "fifo"}, {}, "eviction_policy 'fifo' is not one of"),
        ({"store.batch_objects": 0}, {}, "'batch_objects' must be positive"),
        ({"bogus": 1}, {}, "unknown option --bogus"),
        ({"l1.bogus": 1}, {}, "unknown option --set l1.bogus="),
    ],
)
def test_bad_settings_name_what_to_change(
    flags: dict[str, object], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(flags, environ=environ)


def test_bad_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ValueError, match="--config"):
        load_config({}, str(bad), NO_ENV)
    with pytest.raises(ValueError, match="--config"):
        load_config({}, str(tmp_path / "missing.toml"), NO_ENV)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[l1]\nsize = 3\n")
    with pytest.raises(ValueError, match=r"unknown option l1\.size in --config"):
        load_config({}, str(unknown), NO_ENV)


def test_cache_dir_none_turns_l2_off() -> None:
    assert ServerConfig(cache_dir="none").l2_dir is None


def test_flag_names() -> None:
    assert flag_name("l1.size_bytes") == "--l1-size"
    assert flag_name("http_port") == "--http-port"
    assert flag_name("store.batch_objects") == "--set store.batch_objects=..."


def test_print_config_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtier serve --print-config`` prints what it would run, as a TOML file
    that --config reads back (the token masked)."""
    monkeypatch.setenv("KVTIER_AUTH_TOKEN", "s3cret")
    argv = ["serve", "--print-config", "--l1-size", "64MiB", "--store-policy", "none"]
    argv += ["--set", "l1.high_watermark=0.9", "--set", "limits.max_clients=8"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = tomllib.loads(printed)
    assert data["auth_token"] == "***" and "s3cret" not in printed
    assert data["l1"]["size_bytes"] == 64 << 20 and data["l1"]["high_watermark"] == 0.9
    assert data["store"]["policy"] == "none" and data["limits"]["max_clients"] == 8
    saved = tmp_path / "printed.toml"
    saved.write_text(printed.replace('auth_token = "***"\n', ""))
    again = load_config({}, str(saved), NO_ENV)
    assert again.l1.size_bytes == 64 << 20 and again.limits.max_clients == 8


def test_no_secret_on_a_command_line_or_in_print_config() -> None:
    """Review findings: ``--set auth_token=...`` was taken (a command line
    shows in ps), and ``--print-config`` printed L2 passwords and keys."""
    with pytest.raises(ValueError, match="never a flag"):
        load_config({"auth_token": "sekrit"}, environ={})
    config = load_config(
        {
            "l2": (
                {"type": "redis", "url": "redis://:pw123@cache:6379/0"},
                {"type": "s3", "bucket": "b", "secret_access_key": "SUPERSECRET"},
            )
        },
        environ={},
    )
    printed = dump_toml(config)
    assert "pw123" not in printed and "SUPERSECRET" not in printed
    assert "redis://:***@cache:6379/0" in printed


GOOD_SECRET = "0123456789abcdef0123456789abcdef"


def test_the_cluster_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    rotating = f"{GOOD_SECRET}\n{GOOD_SECRET[::-1]}\n"  # mid-rotation: two
    file = write_secret(tmp_path / "cluster.secret", rotating)
    config = load_config({"cluster_secret_file": str(file)}, environ=NO_ENV)
    sealer = config.sealer
    assert sealer is not None and len(sealer.key_ids) == 2
    from_env = load_config({}, environ={"KVTIER_CLUSTER_SECRET": GOOD_SECRET})
    assert from_env.sealer is not None and from_env.sealer.key_ids[0] == sealer.key_ids[0]
    assert load_config({}, environ=NO_ENV).sealer is None  # no secret: unsealed
    with pytest.raises(ValueError, match=r"--cluster-secret-file .*No such file"):
        load_config({"cluster_secret_file": str(tmp_path / "missing")}, environ=NO_ENV)
    assert GOOD_SECRET not in dump_toml(config)
    with pytest.raises(ValueError, match="never a flag"):
        load_config({"cluster_secret": GOOD_SECRET}, environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("short\n", "secret 1 is 5 characters: at least 32"),
        (f"{GOOD_SECRET} {GOOD_SECRET}\n", "secret 1 is malformed"),
        (f"{GOOD_SECRET}\n{GOOD_SECRET}\n{GOOD_SECRET}\n", "holds 3 secrets: at most 2"),
        ("é" * 40, "secret 1 is malformed"),
    ],
)
def test_a_missing_short_or_malformed_secret_stops_the_server_naming_the_setting(
    tmp_path: Path, text: str, message: str
) -> None:
    file = write_secret(tmp_path / "cluster.secret", text)
    with pytest.raises(ValueError, match=f"--cluster-secret-file .*{message}"):
        load_config({"cluster_secret_file": str(file)}, environ=NO_ENV)
    if text.strip():
        with pytest.raises(ValueError, match=f"KVTIER_CLUSTER_SECRET.*{message}"):
            load_config({}, environ={"KVTIER_CLUSTER_SECRET": text})


# Secret files (kvtier.config.secret_file): text, and private to their owner.

SECRET_FLAGS = ("auth_token_file", "cluster_secret_file")


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


@pytest.mark.parametrize("option", SECRET_FLAGS)
def test_a_binary_secret_file_is_refused_naming_the_flag_and_the_fix(
    tmp_path: Path, option: str
) -> None:
    """``openssl rand 64`` without -hex: the message names the flag, the file
    and how to write it as text (it was a bare UnicodeDecodeError)."""
    file = write_secret(tmp_path / "binary.secret", b"\x80" + bytes(range(63)))
    with pytest.raises(ValueError) as caught:
        load_config({option: str(file)}, environ=NO_ENV)
    message = str(caught.value)
    assert message.startswith(f"{_flag(option)} {file}: not text (byte 0x80 at offset 0")
    assert f"openssl rand -hex 32 > {file}" in message


def test_kvtier_serve_stops_on_a_binary_secret_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = write_secret(tmp_path / "cluster.secret", bytes(range(128, 192)))
    assert main(["serve", "--cluster-secret-file", str(file), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"kvtier serve: --cluster-secret-file {file}: not text" in err
    assert "openssl rand -hex 32" in err


@pytest.mark.parametrize("option", SECRET_FLAGS)
@pytest.mark.parametrize(
    ("mode", "who"),
    [(0o644, "others"), (0o604, "others"), (0o640, "its group"), (0o620, "its group")],
    ids=["0644", "0604", "0640", "0620"],
)
def test_a_secret_file_group_or_others_may_use_is_refused(
    tmp_path: Path, option: str, mode: int, who: str
) -> None:
    file = write_secret(tmp_path / "secret", GOOD_SECRET, mode)
    with pytest.raises(ValueError) as caught:
        load_config({option: str(file)}, environ=NO_ENV)
    assert str(caught.value) == (
        f"{_flag(option)} {file}: mode {mode:04o} lets {who} use this secret file; make it "
        f"private: chmod 600 {file} (a Kubernetes secret volume: defaultMode: 0400)"
    )


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_secret_file_is_taken(tmp_path: Path, mode: int) -> None:
    file = write_secret(tmp_path / "secret", GOOD_SECRET, mode)
    assert load_config({"auth_token_file": str(file)}, environ=NO_ENV).auth_token == GOOD_SECRET


def test_the_mode_checked_is_the_symlinks_target(tmp_path: Path) -> None:
    """Kubernetes mounts a secret as ``token -> ..data/token``, ``..data ->
    ..2024_01_01``: the file read is what must be private, not the links."""
    (tmp_path / "..2024_01_01").mkdir()
    target = write_secret(tmp_path / "..2024_01_01" / "token", GOOD_SECRET, 0o400)
    (tmp_path / "..data").symlink_to("..2024_01_01")
    link = tmp_path / "token"
    link.symlink_to("..data/token")
    assert load_config({"auth_token_file": str(link)}, environ=NO_ENV).auth_token == GOOD_SECRET
    target.chmod(0o644)
    with pytest.raises(ValueError, match=f"--auth-token-file {link}: mode 0644 lets others"):
        load_config({"auth_token_file": str(link)}, environ=NO_ENV)


@pytest.mark.parametrize(
    ("mode", "taken"), [(0o440, True), (0o460, False), (0o444, False)], ids=["0440", "0460", "0444"]
)
def test_its_group_may_read_a_secret_file_someone_else_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, taken: bool
) -> None:
    """Kubernetes with ``fsGroup`` makes ``defaultMode: 0400`` a root-owned
    0440 file the pod reads through its group: taken; group write or any
    access by others is still refused."""
    file = write_secret(tmp_path / "token", GOOD_SECRET, mode)
    monkeypatch.setattr(os, "geteuid", lambda: file.stat().st_uid + 1)  # not the owner
    if taken:
        assert load_config({"auth_token_file": str(file)}, environ=NO_ENV).auth_token
    else:
        with pytest.raises(ValueError, match=f"mode {mode:04o} lets"):
            load_config({"auth_token_file": str(file)}, environ=NO_ENV)


Reader = Callable[[Path, Path, pytest.CaptureFixture[str]], str]


def _refusal(call: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    return str(caught.value)


def _serve(option: str) -> Reader:
    return lambda tmp_path, file, capsys: _refusal(
        lambda: load_config({option: str(file)}, environ=NO_ENV)
    )


def _route(option: str) -> Reader:
    def refusal(tmp_path: Path, file: Path, capsys: pytest.CaptureFixture[str]) -> str:
        from kvtier.router.config import load_router_config
        from tests.unit.router.test_config import CONFIG, write

        config = write(tmp_path, f'{option} = "{file}"\n' + CONFIG)
        return _refusal(lambda: load_router_config({}, config, environ={}))

    return refusal


def _connector(tmp_path: Path, file: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from kvtier.engine.vllm.settings import ConnectorSettings

    extra = {"kvtier.auth_token_file": str(file)}
    return _refusal(lambda: ConnectorSettings.from_extra_config(extra, environ={}))


def _command(*argv: str) -> Reader:
    """A command line (FILE: the secret file) that must exit 2 before it
    reaches the network (the URLs are a closed port)."""

    def refusal(tmp_path: Path, file: Path, capsys: pytest.CaptureFixture[str]) -> str:
        capsys.readouterr()
        assert main([str(file) if arg == "FILE" else arg for arg in argv]) == 2
        return capsys.readouterr().err

    return refusal


NOWHERE = "http://127.0.0.1:9"
READERS: dict[str, tuple[str, Reader]] = {
    "serve auth token": ("--auth-token-file", _serve("auth_token_file")),
    "serve cluster secret": ("--cluster-secret-file", _serve("cluster_secret_file")),
    "route cache token": ("cache_token_file", _route("cache_token_file")),
    "route operator token": ("operator_token_file", _route("operator_token_file")),
    "vllm connector": ("kvtier.auth_token_file", _connector),
    "admin": (
        "--token-file",
        _command("admin", "--url", NOWHERE, "--token-file", "FILE", "status"),
    ),
    "plan": (
        "--auth-token-file",
        _command("plan", "--from-server", NOWHERE, "--auth-token-file", "FILE"),
    ),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_secret_file_reader_refuses_a_world_readable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reader: str
) -> None:
    """Every place kvtier reads a secret or token from a file goes through
    the one checked reader: a 0644 file is refused naming the option."""
    flag, refusal = READERS[reader]
    file = write_secret(tmp_path / "secret", GOOD_SECRET, 0o644)
    message = refusal(tmp_path, file, capsys)
    assert f"{flag} {file}: mode 0644 lets others use this secret file" in message
    assert f"chmod 600 {file}" in message
