"""``kvtier route``'s configuration: the TOML file, flags, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.commands.cli import main
from kvtier.router.config import EngineSpec, load_router_config
from kvtier.router.gateway import TenantSpec

CONFIG = """
policy = "longest_prefix"
port = 0
[cost]
prefill_s_per_token = 0.0005
tier_s_per_token = { L1 = 0.00002, redis = 0.0001 }
[[engines]]
name = "a"
url = "http://127.0.0.1:8001"
events = "tcp://127.0.0.1:5557"
[[engines]]
name = "b"
url = "http://127.0.0.1:8002"
[[tenants]]
name = "acme"
api_keys = ["k1"]
requests_per_s = 5
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "route.toml"
    path.write_text(text)
    return str(path)


def test_the_file_flags_and_environment_make_one_config(tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG)
    config = load_router_config({"policy": "kvtier"}, path, environ={"KVTIER_ROUTE_PORT": "9100"})
    assert config.policy == "kvtier" and config.port == 9100  # flag > env > file
    assert config.engines == (
        EngineSpec(name="a", url="http://127.0.0.1:8001", events="tcp://127.0.0.1:5557"),
        EngineSpec(name="b", url="http://127.0.0.1:8002"),
    )
    assert config.tenants == (TenantSpec(name="acme", api_keys=("k1",), requests_per_s=5.0),)
    assert config.cost.tier_s_per_token == {"L1": 2e-5, "fs": 5e-5, "redis": 1e-4}  # merged
    engines = [{"name": "x", "url": "http://h:1"}]
    assert load_router_config({"engines": engines}).engines[0].name == "x"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("policy = 'kvtier'", "needs engines"),
        ("[[engines]]\nname = 'a'\nurl = 'ftp://x'", "http"),
        (
            "[[engines]]\nname = 'a'\nurl = 'http://x'\n[[engines]]\nname = 'a'\nurl = 'http://y'",
            "share",
        ),
        ("[[engines]]\nname = 'a'\nurl = 'http://x'\ncolour = 1", "unknown option 'colour'"),
        ("policy = 'random'\n[[engines]]\nname = 'a'\nurl = 'http://x'", "policy"),
        (
            "[[engines]]\nname = 'a'\nurl = 'http://x'\n"
            "[[tenants]]\nname = 't'\nrequests_per_s = -1",
            "requests_per_s",
        ),
        (
            "[[engines]]\nname = 'a'\nurl = 'http://x'\n[[tenants]]\nname = 't'\napi_keys = ['k']\n"
            "[[tenants]]\nname = 'u'\napi_keys = ['k']",
            "two tenants",
        ),
    ],
)
def test_bad_configs_say_what_to_change(tmp_path: Path, text: str, message: str) -> None:
    from kvtier.router.gateway import Gateway

    with pytest.raises(ValueError, match=message):
        config = load_router_config({}, write(tmp_path, text))
        Gateway(config.tenant_specs())


def test_the_command_line_reports_a_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["route", "--config", write(tmp_path, "port = 0")]) != 0
    assert "needs engines" in capsys.readouterr().err


def test_the_cache_servers_tenants_file_gives_the_gateway_its_tenants(tmp_path: Path) -> None:
    """Its token digests become API keys, its first salt the cache_salt; a
    [[tenants]] table of the same name adds its limits."""
    from kvtier.router.gateway import Gateway
    from kvtier.tenancy.tenants import token_digest

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "acme"\ntoken_sha256 = ["{token_digest("acme-token")}"]\n'
        'salts = ["acme-prod"]\n'
        f'[[tenant]]\nname = "globex"\ntoken_sha256 = ["{token_digest("globex-token")}"]\n'
        'salts = ["globex"]\n'
    )
    config = load_router_config({}, write(tmp_path, f'tenants_file = "{tenants}"\n' + CONFIG))
    by_name = {spec.name: spec for spec in config.tenants}
    assert by_name["acme"].cache_salt == "acme-prod" and by_name["acme"].requests_per_s == 5
    assert by_name["acme"].api_keys == ("k1",)  # the route file's own key still works
    gateway = Gateway(config.tenants)
    for key, name in (("acme-token", "acme"), ("k1", "acme"), ("globex-token", "globex")):
        tenant = gateway.authenticate(f"Bearer {key}")
        assert tenant is not None and tenant.name == name
    assert gateway.authenticate("Bearer nobody") is None
    with pytest.raises(ValueError, match="SHA-256"):
        TenantSpec(name="x", api_key_sha256=("not-a-digest",))


def test_the_tokens_come_from_files_or_the_environment_never_shown(tmp_path: Path) -> None:
    """cache_token (for the cache servers) and operator_token (for /status and
    /metrics): from a file the config names, or KVTIER_ROUTE_*; not in repr."""
    from kvtier.router.gateway import Gateway

    (tmp_path / "cache.token").write_text("cache-secret\n")
    (tmp_path / "operator.token").write_text("operator-secret\n")
    for token in ("cache.token", "operator.token"):
        (tmp_path / token).chmod(0o600)  # a secret file group or others may read is refused
    files = (
        f'cache_token_file = "{tmp_path / "cache.token"}"\n'
        f'operator_token_file = "{tmp_path / "operator.token"}"\n'
    )
    config = load_router_config({}, write(tmp_path, files + CONFIG), environ={})
    assert config.cache_token == "cache-secret" and config.operator_token == "operator-secret"
    assert "secret" not in repr(config)
    environ = {"KVTIER_ROUTE_CACHE_TOKEN": "c", "KVTIER_ROUTE_OPERATOR_TOKEN": "o"}
    config = load_router_config({}, write(tmp_path, CONFIG), environ=environ)
    assert (config.cache_token, config.operator_token) == ("c", "o")
    gateway = Gateway(config.tenant_specs(), operator_token=config.operator_token)
    assert gateway.operator("Bearer o") and not gateway.operator("Bearer k1")
    with pytest.raises(ValueError, match="cache_token_file"):
        load_router_config({}, write(tmp_path, 'cache_token_file = "/nonexistent"\n' + CONFIG))
    with pytest.raises(ValueError, match="operator_token is also a tenant's API key"):
        Gateway(config.tenant_specs(), operator_token="k1")
