"""The tuner's settings are declared once (`hexgen_service.tuner_config`): its command line
is generated from them, rendered from them, and the launchers' tuner command lines are
rendered through them.

Every field round-trips (a non-default value rendered and parsed back), ``--help`` lists
the fields' options and nothing else, ``hexgen-flow up``'s and ``up --shards``' tuner
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

from hexgen_client.addresses import DEFAULT_COORDINATOR, DEFAULT_REDIS_URL, DEFAULT_TUNER
from hexgen_flow.errors import ConfigError
from hexgen_launch.cluster_config import LocalClusterConfig, secure_argv, secure_settings
from hexgen_launch.cluster_config import tuner_argv as up_tuner_argv
from hexgen_launch.processes import ManagedProcess
from hexgen_launch.sharded_mesh import CoordinatorProcess, LocalShardedMesh, ShardedMeshConfig
from hexgen_service.auth_dir import AuthDir
from hexgen_service.redis_schema import CLUSTER_PREFIX
from hexgen_service.settings import option_of
from hexgen_service.tls import add_tls_options
from hexgen_service.tuner_config import add_tuner_options, tuner_config_from_args
from hexgen_tuner.__main__ import parse_config
from hexgen_tuner.config import TunerConfig, tuner_argv

FIELDS = tuple(f.name for f in dataclasses.fields(TunerConfig))

CODE_ONLY: dict[str, Any] = {"runs_kept": 20, "rpc_timeout_s": 2.0}
"""Settings with no option (set from code), and a valid value other than the default."""

NON_DEFAULT: dict[str, Any] = {
    "listen": "127.0.0.1:6001",
    "coordinator": "127.0.0.1:6002,127.0.0.1:6003",
    "shards": ("hf:{1}:", "hf:{2}:"),
    "redis_url": "redis://127.0.0.1:6380/1",
    "redis_prefix": "hf:{9}:",
    "redis_cluster": True,
    "period_s": 5.0,
    "window": 100,
    "min_queries": 10,
    "seed": 7,
    "tolerance": 0.0,
    "calibration": "aiconfigurator",
    "metrics_listen": "127.0.0.1:6004",
    "api_keys_file": "/keys.json",
    "tls_cert": "/tls/cert.pem",
    "tls_key": "/tls/key.pem",
    "tls_ca": "/tls/ca.pem",
    "api_key_file": "/tuner.key",
    "redis_password_file": "/redis.password",
    "insecure": True,
    "log_level": "DEBUG",
}
"""A valid value other than the default for every setting on the command line (all of
them together are valid too)."""

TOGETHER: dict[str, dict[str, Any]] = {
    "redis_cluster": {"redis_prefix": "hf:{9}:"},  # a cluster's prefix holds a hash tag
    "tls_cert": {"tls_key": "/tls/key.pem"},
    "tls_key": {"tls_cert": "/tls/cert.pem"},
}
"""What a setting needs beside it to be valid (checked between settings)."""

BAD: dict[str, tuple[str, str]] = {
    "period_s": ("0", "--period-s must be a finite number of seconds > 0, got 0.0"),
    "window": ("0", "--window must be >= 1"),
    "min_queries": ("0", "--min-queries must be >= 1"),
    "tolerance": ("1.5", "--tolerance must be in [0, 1), got 1.5"),
}
"""A value each option with a check refuses, and the message (after ``error: ``)."""

BAD_CODE_ONLY: dict[str, tuple[Any, str]] = {
    "runs_kept": (0, "runs_kept must be >= 1"),
    "rpc_timeout_s": (0.0, "rpc_timeout_s must be > 0"),
}
"""The code-only settings' checks name the field (there is no flag)."""


def _flag(name: str) -> str:
    return option_of(TunerConfig, name).flag or "--" + name.replace("_", "-")


def _generated_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_tuner_options(parser)
    add_tls_options(parser, serves="TLS")
    return parser


def _parse(argv: list[str]) -> TunerConfig:
    return tuner_config_from_args(_generated_parser().parse_args(argv))


# ------------------------------------------------------------------------ (a) round trips


def test_every_setting_has_a_non_default_value_here() -> None:
    """A new setting must be added to NON_DEFAULT (and so to the round trips below)."""
    assert set(NON_DEFAULT) | set(CODE_ONLY) == set(FIELDS)
    defaults = TunerConfig()
    for name, value in {**NON_DEFAULT, **CODE_ONLY}.items():
        assert value != getattr(defaults, name), name
    for name in CODE_ONLY:
        assert option_of(TunerConfig, name).code_only, name


def test_the_defaults_are_the_meshs_addresses() -> None:
    defaults = TunerConfig()
    assert (defaults.listen, defaults.coordinator, defaults.redis_url) == (
        DEFAULT_TUNER,
        DEFAULT_COORDINATOR,
        DEFAULT_REDIS_URL,
    )


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_setting_renders_and_parses_back(name: str) -> None:
    given = {name: NON_DEFAULT[name], **TOGETHER.get(name, {})}
    config = TunerConfig(**given)
    argv = tuner_argv(config)
    flags = {a for a in argv if a.startswith("--")}
    expected = set()
    for field, value in given.items():  # only what differs
        expected.add(_flag(field) if value is not False else "--no-" + _flag(field)[2:])
    assert flags == expected
    assert _parse(argv) == config


def test_every_setting_at_once_and_the_full_form_round_trip() -> None:
    config = TunerConfig(**NON_DEFAULT)
    assert _parse(tuner_argv(config)) == config
    assert _parse(tuner_argv(config, only_changed=False)) == config
    full = tuner_argv(TunerConfig(), only_changed=False)
    assert "--no-redis-cluster" in full and "--redis-prefix" in full
    assert _parse(full) == TunerConfig()
    assert tuner_argv(TunerConfig()) == []


def test_a_redis_cluster_without_a_prefix_takes_the_cluster_default() -> None:
    assert _parse(["--redis-cluster"]).redis_prefix == CLUSTER_PREFIX
    with pytest.raises(ConfigError, match=r"^--redis-prefix 'hf:': a Redis Cluster needs"):
        _parse(["--redis-cluster", "--redis-prefix", "hf:"])


def test_the_tuners_own_parser_round_trips_too(tmp_path: Path) -> None:
    """Through ``python -m hexgen_tuner``'s `parse_config`, which also reads the files the
    security options name (here, real ones)."""
    (tmp_path / "tuner.key").write_text("k\n")
    (tmp_path / "redis.password").write_text("p\n")
    files = {
        "api_keys_file": "",
        "tls_cert": None,
        "tls_key": None,
        "tls_ca": None,
        "api_key_file": str(tmp_path / "tuner.key"),
        "redis_password_file": str(tmp_path / "redis.password"),
    }
    config = TunerConfig(**{**NON_DEFAULT, **files})
    assert parse_config(tuner_argv(config)) == config


def test_the_code_only_settings_are_no_options() -> None:
    parser = _generated_parser()
    for name in CODE_ONLY:
        with pytest.raises(SystemExit):
            parser.parse_args([_flag(name), "1"])


# ------------------------------------------------------------------------ (b) --help


def test_every_option_of_the_tuner_is_a_setting() -> None:
    """``--help`` lists exactly the settings' options (a bool's ``--no-`` form too): none
    is declared by hand beside them."""
    out = subprocess.run(
        [sys.executable, "-m", "hexgen_tuner", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    usage = out.split("\n\n", 1)[0]
    listed = set(re.findall(r"\[(--[a-z0-9-]+)", usage)) | set(
        re.findall(r"\| (--[a-z0-9-]+)", usage)
    )
    expected: set[str] = set()
    defaults = TunerConfig()
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


def test_up_renders_its_tuner_through_the_settings() -> None:
    config = LocalClusterConfig(redis_prefix="hx:", tuner_period_s=2.5)
    argv = up_tuner_argv(
        config, "127.0.0.1:7001", "127.0.0.1:7002", "redis://127.0.0.1:6379/3",
        "chess-measured", "127.0.0.1:7003",
    )  # fmt: skip
    assert argv[:3] == [config.python, "-m", "hexgen_tuner"]
    assert parse_config(argv[3:]) == TunerConfig(
        listen="127.0.0.1:7001", coordinator="127.0.0.1:7002",
        redis_url="redis://127.0.0.1:6379/3", redis_prefix="hx:", period_s=2.5,
        calibration="chess-measured", metrics_listen="127.0.0.1:7003",
    )  # fmt: skip
    # what a default mesh's tuner was always given, and no more
    plain = up_tuner_argv(LocalClusterConfig(), "127.0.0.1:7001", "127.0.0.1:7002", "redis://r")
    assert plain[3:] == [
        "--listen", "127.0.0.1:7001", "--coordinator", "127.0.0.1:7002",
        "--redis-url", "redis://r", "--redis-prefix", "hf:", "--period-s", "30.0",
    ]  # fmt: skip


def test_up_secure_renders_its_tuner_with_the_credentials(tmp_path: Path) -> None:
    """A secured mesh's tuner is one configuration, credentials included, so that its
    metrics door beyond loopback is checked against them (not refused without them)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(("a",))
    argv = up_tuner_argv(
        LocalClusterConfig(), "127.0.0.1:7001", "127.0.0.1:7002", "redis://r", None,
        "0.0.0.0:7003", auth,
    )  # fmt: skip
    secured = secure_settings(auth, "tuner")
    assert parse_config(argv[3:]) == TunerConfig(
        listen="127.0.0.1:7001", coordinator="127.0.0.1:7002", redis_url="redis://r",
        metrics_listen="0.0.0.0:7003", **secured,
    )  # fmt: skip
    assert secure_argv(auth, "tuner") == tuner_argv(TunerConfig(**secured))
    with pytest.raises(ConfigError, match=r"^--metrics-listen: refusing to listen on 0\.0\.0\.0"):
        up_tuner_argv(
            LocalClusterConfig(), "127.0.0.1:7001", "127.0.0.1:7002", "redis://r", None,
            "0.0.0.0:7003",
        )  # fmt: skip


def test_up_on_a_redis_cluster_gives_the_tuner_the_clusters_prefix() -> None:
    config = LocalClusterConfig(redis_cluster=True, redis_url="redis://n:7000/0")
    argv = up_tuner_argv(config, "127.0.0.1:7001", "127.0.0.1:7002", "redis://n:7000/0")
    parsed = parse_config(argv[3:])
    assert parsed.redis_cluster and parsed.redis_prefix == CLUSTER_PREFIX
    # a cluster's prefix without a hash tag: the launcher refuses what the tuner would
    with pytest.raises(ConfigError, match="--redis-prefix 'hx:': a Redis Cluster needs"):
        up_tuner_argv(
            LocalClusterConfig(redis_cluster=True, redis_url="redis://n", redis_prefix="hx:"),
            "127.0.0.1:7001", "127.0.0.1:7002", "redis://n",
        )  # fmt: skip


def _coordinators(at: Path) -> list[CoordinatorProcess]:
    return [
        CoordinatorProcess(f"s{k}", f"127.0.0.1:{7100 + k}", f"127.0.0.1:{7200 + k}", process)
        for k, process in enumerate(_unstarted(at, 3))
    ]


@pytest.mark.parametrize("redis_cluster", [False, True])
def test_up_shards_renders_its_tuner_through_the_settings(
    redis_cluster: bool, tmp_path: Path
) -> None:
    mesh = LocalShardedMesh(
        ShardedMeshConfig(
            "redis://127.0.0.1:7000/0", tmp_path, shards=2, tuner_period_s=4.0,
            redis_cluster=redis_cluster,
        )
    )  # fmt: skip
    mesh.coordinators = _coordinators(tmp_path)  # two shards and a spare, not started
    argv = mesh.tuner_argv("127.0.0.1:7001", "redis://127.0.0.1:7000/0")
    parsed = parse_config(argv)
    assert parsed == TunerConfig(
        listen="127.0.0.1:7001", coordinator="127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102",
        shards=("hf:{s0}:", "hf:{s1}:"),
        redis_url="redis://127.0.0.1:7000/0", redis_prefix=mesh.config.tuner_prefix,
        redis_cluster=redis_cluster, period_s=4.0,
    )  # fmt: skip


# ------------------------------------------------------------------------ (d) bad values


def test_every_checked_setting_has_a_bad_value_here() -> None:
    checked = {n for n in FIELDS if option_of(TunerConfig, n).check is not None}
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
    assert capsys.readouterr().err == f"hexgen-tuner: error: {message}\n"
    with pytest.raises(ConfigError, match=re.escape(message)):
        kind: Any = type(getattr(TunerConfig(), name))
        TunerConfig(**{name: kind(value)})


@pytest.mark.parametrize("name", sorted(BAD_CODE_ONLY))
def test_a_bad_code_only_value_names_its_field(name: str) -> None:
    value, message = BAD_CODE_ONLY[name]
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        TunerConfig(**{name: value})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window", "10", "--min-queries", "20"], "--min-queries (20) must not exceed --window"),
        (["--tolerance", "1.5"], "--tolerance must be in [0, 1), got 1.5"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--window", "x"], "argument --window: invalid int value: 'x'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_the_tuner_process_exits_2_with_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_tuner", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"hexgen-tuner: error: {message}")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
