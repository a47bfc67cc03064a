"""The gateway's settings are declared once (`hexgen_service.gateway_config`): its command
line is generated from them, rendered from them, and the launchers' gateway command lines
are rendered through them.

Every field round-trips (a non-default value rendered and parsed back), ``--help`` lists
the fields' options and nothing else, ``hexgen-flow up``'s and ``up --shards``' gateway
command lines parse into the settings they meant, and a bad value is one line naming its
flag, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hexgen_client.addresses import DEFAULT_COORDINATOR, DEFAULT_GATEWAY
from hexgen_flow.errors import ConfigError
from hexgen_gateway.__main__ import parse_config
from hexgen_gateway.config import GatewayConfig, gateway_argv
from hexgen_launch.cluster_config import LocalClusterConfig, secure_argv, secure_settings
from hexgen_launch.cluster_config import gateway_argv as up_gateway_argv
from hexgen_launch.processes import ManagedProcess
from hexgen_launch.sharded_mesh import CoordinatorProcess, LocalShardedMesh, ShardedMeshConfig
from hexgen_service.auth_dir import AuthDir
from hexgen_service.convert import MAX_TOKENS_PER_CALL
from hexgen_service.gateway_config import add_gateway_options, gateway_config_from_args
from hexgen_service.settings import option_of
from hexgen_service.tls import add_tls_options

FIELDS = tuple(f.name for f in dataclasses.fields(GatewayConfig))

CODE_ONLY: dict[str, Any] = {"rpc_timeout_s": 2.0, "models_ttl_s": 0.0}
"""Settings with no option (set from code), and a valid value other than the default."""

NON_DEFAULT: dict[str, Any] = {
    "listen": "127.0.0.1:6001",
    "coordinator": "127.0.0.1:6002,127.0.0.1:6003",
    "default_stage": "plan",
    "default_max_tokens": 64,
    "max_body_bytes": 1024,
    "request_timeout_s": 30.0,
    "session_idle_s": 0.0,
    "metrics": False,
    "tls_cert": "/tls/cert.pem",
    "tls_key": "/tls/key.pem",
    "tls_ca": "/tls/ca.pem",
    "api_key_file": "/gateway.key",
    "insecure": True,
    "log_level": "DEBUG",
}
"""A valid value other than the default for every setting on the command line (all of
them together are valid too)."""

TOGETHER: dict[str, dict[str, Any]] = {
    "tls_cert": {"tls_key": "/tls/key.pem"},
    "tls_key": {"tls_cert": "/tls/cert.pem"},
}
"""What a setting needs beside it to be valid (checked between settings)."""

BAD: dict[str, tuple[str, str]] = {
    "listen": ("nohost", "--listen must be HOST:PORT, got 'nohost'"),
    "coordinator": ("a:1,b:x", "--coordinator must be HOST:PORT, got 'b:x'"),
    "default_stage": (" ", "--default-stage must be a non-empty name"),
    "default_max_tokens": (
        "0",
        f"--default-max-tokens must be from 1 to {MAX_TOKENS_PER_CALL}, got 0",
    ),
    "max_body_bytes": ("0", "--max-body-bytes must be >= 1"),
    "request_timeout_s": ("inf", "--request-timeout-s must be finite and > 0, got inf"),
    "session_idle_s": (
        "-1",
        "--session-idle-s must be finite and >= 0 (0: the coordinator's), got -1.0",
    ),
}
"""A value each option with a check refuses, and the message (after ``error: ``)."""

BAD_CODE_ONLY: dict[str, tuple[Any, str]] = {
    "rpc_timeout_s": (0.0, "rpc_timeout_s must be finite and > 0, got 0.0"),
    "models_ttl_s": (-1.0, "models_ttl_s must be >= 0, got -1.0"),
}
"""The code-only settings' checks name the field (there is no flag)."""


def _flag(name: str) -> str:
    return option_of(GatewayConfig, name).flag or "--" + name.replace("_", "-")


def _generated_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_gateway_options(parser)
    add_tls_options(parser, serves="HTTPS")
    return parser


def _parse(argv: list[str]) -> GatewayConfig:
    return gateway_config_from_args(_generated_parser().parse_args(argv))


# ------------------------------------------------------------------------ (a) round trips


def test_every_setting_has_a_non_default_value_here() -> None:
    """A new setting must be added to NON_DEFAULT (and so to the round trips below)."""
    assert set(NON_DEFAULT) | set(CODE_ONLY) == set(FIELDS)
    defaults = GatewayConfig()
    for name, value in {**NON_DEFAULT, **CODE_ONLY}.items():
        assert value != getattr(defaults, name), name
    for name in CODE_ONLY:
        assert option_of(GatewayConfig, name).code_only, name


def test_the_defaults_are_the_meshs_addresses() -> None:
    defaults = GatewayConfig()
    assert (defaults.listen, defaults.coordinator) == (DEFAULT_GATEWAY, DEFAULT_COORDINATOR)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_setting_renders_and_parses_back(name: str) -> None:
    given = {name: NON_DEFAULT[name], **TOGETHER.get(name, {})}
    config = GatewayConfig(**given)
    argv = gateway_argv(config)
    flags = {a for a in argv if a.startswith("--")}
    expected = set()
    for field, value in given.items():  # only what differs
        expected.add(_flag(field) if value is not False else "--no-" + _flag(field)[2:])
    assert flags == expected
    assert _parse(argv) == config


def test_every_setting_at_once_and_the_full_form_round_trip() -> None:
    config = GatewayConfig(**NON_DEFAULT)
    assert _parse(gateway_argv(config)) == config
    assert _parse(gateway_argv(config, only_changed=False)) == config
    full = gateway_argv(GatewayConfig(), only_changed=False)
    assert full[:4] == ["--listen", DEFAULT_GATEWAY, "--coordinator", DEFAULT_COORDINATOR]
    assert "--metrics" in full and "--no-insecure" in full
    assert _parse(full) == GatewayConfig()
    assert gateway_argv(GatewayConfig()) == []


def test_coordinators_repeated_or_listed_are_one_list_each_once() -> None:
    argv = ["--coordinator", "a:1,b:2", "--coordinator", " b:2 ", "--coordinator", "c:3"]
    assert _parse(argv).coordinator == "a:1,b:2,c:3"
    with pytest.raises(ConfigError, match=r"^--coordinator: no coordinator address in"):
        _parse(["--coordinator", " , "])


def test_the_gateways_own_parser_round_trips_too(tmp_path: Path) -> None:
    """Through ``python -m hexgen_gateway``'s `parse_config`, which also reads the files
    the security options name (here, a real one)."""
    (tmp_path / "gateway.key").write_text("k\n")
    files = {"tls_cert": None, "tls_key": None, "tls_ca": None}
    config = GatewayConfig(
        **{**NON_DEFAULT, **files, "api_key_file": str(tmp_path / "gateway.key")}
    )
    assert parse_config(gateway_argv(config)) == (config, "DEBUG")


def test_the_code_only_settings_are_no_options() -> None:
    parser = _generated_parser()
    for name in CODE_ONLY:
        with pytest.raises(SystemExit):
            parser.parse_args([_flag(name), "1"])


# ------------------------------------------------------------------------ (b) --help


def test_every_option_of_the_gateway_is_a_setting() -> None:
    """``--help`` lists exactly the settings' options (a bool's ``--no-`` form too): none
    is declared by hand beside them but ``--coordinator``, a setting spelled by hand."""
    out = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    usage = out.split("\n\n", 1)[0]
    listed = set(re.findall(r"\[(--[a-z0-9-]+)", usage)) | set(
        re.findall(r"\| (--[a-z0-9-]+)", usage)
    )
    expected: set[str] = set()
    defaults = GatewayConfig()
    for name in FIELDS:
        if name in CODE_ONLY:
            continue
        expected.add(_flag(name))
        if isinstance(getattr(defaults, name), bool):
            expected.add("--no-" + _flag(name)[2:])
    assert listed == expected


def _unstarted(at: Path, n: int) -> list[ManagedProcess]:
    """`n` coordinator processes never started (a launcher's argv needs their addresses)."""
    return [ManagedProcess(f"coordinator s{k}", ["true"], at / f"s{k}.log") for k in range(n)]


# ------------------------------------------------------------------------ (c) the launchers


def test_up_renders_its_gateway_through_the_settings() -> None:
    config = LocalClusterConfig()
    argv = up_gateway_argv(config, "127.0.0.1:8001", "127.0.0.1:50051")
    assert argv == [
        config.python, "-m", "hexgen_gateway",
        "--listen", "127.0.0.1:8001", "--coordinator", "127.0.0.1:50051",
    ]  # fmt: skip
    assert parse_config(argv[3:]) == (
        GatewayConfig(listen="127.0.0.1:8001", coordinator="127.0.0.1:50051"),
        "INFO",
    )


def test_up_secure_renders_its_gateway_with_the_credentials(tmp_path: Path) -> None:
    """A secured mesh's gateway is one configuration, credentials included, so that its
    door beyond loopback is checked against them (not refused without them)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(("a",))
    argv = up_gateway_argv(LocalClusterConfig(), "0.0.0.0:8001", "127.0.0.1:50051", auth)
    secured = secure_settings(auth, "gateway")
    config, _ = parse_config(argv[3:])
    assert config.https
    assert config == GatewayConfig(listen="0.0.0.0:8001", coordinator="127.0.0.1:50051", **secured)
    assert secure_argv(auth, "gateway") == gateway_argv(GatewayConfig(**secured))
    with pytest.raises(ConfigError, match=r"^--listen: refusing to listen on 0\.0\.0\.0:8001"):
        up_gateway_argv(LocalClusterConfig(), "0.0.0.0:8001", "127.0.0.1:50051")


def test_up_shards_renders_its_gateway_through_the_settings(tmp_path: Path) -> None:
    mesh = LocalShardedMesh(ShardedMeshConfig("redis://127.0.0.1:7000/0", tmp_path))
    mesh.coordinators = [
        CoordinatorProcess(f"s{k}", f"127.0.0.1:{7100 + k}", f"127.0.0.1:{7200 + k}", process)
        for k, process in enumerate(_unstarted(tmp_path, 3))
    ]
    config, _ = parse_config(mesh.gateway_argv("127.0.0.1:8001"))
    assert config == GatewayConfig(
        listen="127.0.0.1:8001", coordinator="127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102"
    )


def test_the_launcher_refuses_what_the_gateway_would() -> None:
    with pytest.raises(ConfigError, match=r"^--listen must be HOST:PORT"):
        up_gateway_argv(LocalClusterConfig(), "localhost", "127.0.0.1:50051")


# ------------------------------------------------------------------------ (d) bad values


def test_every_checked_setting_has_a_bad_value_here() -> None:
    checked = {n for n in FIELDS if option_of(GatewayConfig, n).check is not None}
    assert set(BAD) | set(BAD_CODE_ONLY) == checked
    assert set(BAD_CODE_ONLY) == set(CODE_ONLY)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_one_line_naming_its_flag(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value, message = BAD[name]
    with pytest.raises(SystemExit) as exited:
        parse_config([_flag(name), value])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"hexgen-gateway: error: {message}\n"
    with pytest.raises(ConfigError, match=re.escape(message)):
        kind: Any = type(getattr(GatewayConfig(), name))
        GatewayConfig(**{name: kind(value)})


@pytest.mark.parametrize("name", sorted(BAD_CODE_ONLY))
def test_a_bad_code_only_value_names_its_field(name: str) -> None:
    value, message = BAD_CODE_ONLY[name]
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        GatewayConfig(**{name: value})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--default-max-tokens", "0"], "--default-max-tokens must be from 1 to"),
        (["--listen", "0.0.0.0:8000"], "--listen: refusing to listen on 0.0.0.0:8000"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--max-body-bytes", "x"], "argument --max-body-bytes: invalid int value: 'x'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_the_gateway_process_exits_2_with_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_gateway", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"hexgen-gateway: error: {message}")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
