"""Typed config loading: file, environment and overrides, with errors that name the field and its source."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from k3.services.cache.service import CacheServiceConfig
from k3.services.common.config import ConfigError, ServerConfig, describe, documented, load_config


@dataclass
class Inner:
    ratio: float = documented(0.5, doc="a float")
    tags: list[str] = documented(default_factory=list, doc="a list")
    limit: int | None = documented(None, doc="an optional int")

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ConfigError(f"must be in [0, 1], got {self.ratio}", field="ratio")


@dataclass
class Sample:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=7000))
    inner: Inner = field(default_factory=Inner)
    name: str = "sample"
    verbose: bool = False


def _write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_respect_section_default_factories():
    config = load_config(Sample, env={})
    assert config.server.port == 7000  # from the section's default_factory, not ServerConfig's 50051
    assert config.server.host == "127.0.0.1"
    assert config.server.max_message_bytes == 64 * 1024 * 1024
    assert config.server.auth_token is None and config.server.otlp_endpoint is None
    assert config.inner == Inner()


def test_file_env_and_overrides_in_order_of_precedence(tmp_path):
    path = _write(
        tmp_path,
        "server:\n  port: 9000\n  host: 0.0.0.0\n  grace_seconds: 3\ninner:\n  tags: [a, b]\n  ratio: 1\nverbose: true\n",
    )
    env = {"K3_SERVER_PORT": "9100", "K3_INNER_LIMIT": "12", "K3_INNER_TAGS": "x, y", "UNRELATED": "1"}
    config = load_config(Sample, path, env=env, overrides={"server.port": 9200, "server.host": None})
    assert config.server.port == 9200  # override > env > file
    assert config.server.host == "0.0.0.0"  # None overrides are ignored
    assert config.server.grace_seconds == 3.0 and isinstance(config.server.grace_seconds, float)
    assert config.inner.tags == ["x", "y"] and config.inner.limit == 12 and config.inner.ratio == 1.0
    assert config.verbose is True


def test_json_file(tmp_path):
    path = _write(tmp_path, '{"server": {"port": 1234, "metrics": false}, "inner": {"limit": null}}', "c.json")
    config = load_config(Sample, path, env={})
    assert config.server.port == 1234 and config.server.metrics is False and config.inner.limit is None


def test_auth_token_env_alias_and_precedence():
    assert load_config(Sample, env={"K3_AUTH_TOKEN": "t1"}).server.auth_token == "t1"
    both = {"K3_AUTH_TOKEN": "t1", "K3_SERVER_AUTH_TOKEN": "t2"}
    assert load_config(Sample, env=both).server.auth_token == "t2"
    assert load_config(Sample, env={"K3_SERVER_AUTH_TOKEN": "none"}).server.auth_token is None


def test_env_booleans(tmp_path):
    assert load_config(Sample, env={"K3_VERBOSE": "yes", "K3_SERVER_TRACING": "0"}).verbose is True
    assert load_config(Sample, env={"K3_SERVER_TRACING": "off"}).server.tracing is False
    with pytest.raises(ConfigError) as info:
        load_config(Sample, env={"K3_VERBOSE": "maybe"})
    assert str(info.value) == "$K3_VERBOSE: verbose: must be bool, got 'maybe'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server:\n  port: [1\n", "invalid YAML at line 3 column 1"),
        ("server:\n  prot: 1\n", "server.prot: unknown key (known: auth_token, grace_seconds, host,"),
        ("bogus: 1\n", "bogus: unknown key (known: inner, name, server, verbose)"),
        ("server:\n  port: '80'\n", "server.port: must be int, got str '80'"),
        ("server:\n  port: true\n", "server.port: must be int, got bool True"),
        ("server:\n  metrics: 1\n", "server.metrics: must be bool, got int 1"),
        ("server: 5\n", "server: must be a mapping (section), got int"),
        ("inner:\n  tags: [a, 3]\n", "inner.tags[1]: must be str, got int 3"),
        ("inner:\n  tags: a\n", "inner.tags: must be list[str], got str"),
        ("server:\n  host: null\n", "server.host: must be str, got null"),
        ("server:\n  port: 70000\n", "server.port: must be in 0..65535, got 70000"),
        ("inner:\n  ratio: 2\n", "inner.ratio: must be in [0, 1], got 2.0"),
        ("- a\n- b\n", "top level must be a mapping, got list"),
    ],
)
def test_bad_files_name_file_and_field(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(Sample, path, env={})
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_bad_json_names_position(tmp_path):
    path = _write(tmp_path, '{"server": {"port": 1,}}', "c.json")
    with pytest.raises(ConfigError, match=r"c\.json: invalid JSON at line 1 column 23"):
        load_config(Sample, path, env={})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file: No such file or directory"):
        load_config(Sample, tmp_path / "absent.yaml", env={})


def test_validation_error_names_the_source_of_the_value(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(Sample, env={"K3_SERVER_MAX_WORKERS": "0"})
    assert str(info.value) == "$K3_SERVER_MAX_WORKERS: server.max_workers: must be >= 1, got 0"
    assert (info.value.field, info.value.source) == ("server.max_workers", "$K3_SERVER_MAX_WORKERS")
    with pytest.raises(ConfigError, match=r"^override: server.port: must be in 0..65535, got -1$"):
        load_config(Sample, env={}, overrides={"server.port": -1})
    with pytest.raises(ConfigError, match=r"^override: server.port: must be int, got str 'x'$"):
        load_config(Sample, env={}, overrides={"server.port": "x"})


def test_cache_service_config_sections(tmp_path):
    path = _write(tmp_path, f"store:\n  memory_bytes: 1048576\n  max_value_bytes: 65536\n  disk_dir: {tmp_path}\n")
    config = load_config(CacheServiceConfig, path, env={"K3_STORE_REDIS_URL": "redis://localhost:6379/0"})
    assert config.store.memory_bytes == 1 << 20 and config.store.disk_dir == str(tmp_path)
    assert config.store.redis_url == "redis://localhost:6379/0"
    assert config.server == ServerConfig()
    # A default (max_value_bytes) clashing with a configured value: blame the file that set the section.
    bad = _write(tmp_path, "store:\n  memory_bytes: 1024\n")
    with pytest.raises(ConfigError) as info:
        load_config(CacheServiceConfig, bad, env={})
    assert (info.value.field, info.value.source) == ("store.max_value_bytes", str(bad))
    assert "must not exceed memory_bytes (1024)" in str(info.value)


@dataclass
class PlainChecks:
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


@dataclass
class WithPlainSection:
    part: PlainChecks = field(default_factory=PlainChecks)


def test_plain_value_error_from_a_section_becomes_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(WithPlainSection, env={"K3_PART_SIZE": "0"})
    assert str(info.value) == "$K3_PART_SIZE: part: size must be >= 1, got 0"


def test_required_fields_and_non_dataclasses():
    @dataclass
    class Needs:
        url: str

    with pytest.raises(ConfigError, match="^url: required field is missing$"):
        load_config(Needs, env={})
    assert load_config(Needs, env={"K3_URL": "x"}).url == "x"
    with pytest.raises(TypeError, match="is not a dataclass"):
        load_config(dict, env={})


def test_describe_lists_documented_leaves():
    rows = {path: (tp, default, doc) for path, tp, default, doc in describe(Sample)}
    assert rows["server.port"] == ("int", "7000", "TCP port; 0 picks a free port (the bound port is reported).")
    assert rows["server.auth_token"][0] == "str or null"
    assert rows["inner.tags"][:2] == ("list[str]", "[]")


def test_server_config_validates_on_construction():
    with pytest.raises(ConfigError, match="max_message_bytes: must be >= 1024"):
        ServerConfig(max_message_bytes=10)
    with pytest.raises(ConfigError, match="auth_token: must not be blank"):
        ServerConfig(auth_token="  ")
    assert ServerConfig(host="::1", port=5).address == "[::1]:5"
    assert ServerConfig(host="localhost", port=5).address == "localhost:5"
