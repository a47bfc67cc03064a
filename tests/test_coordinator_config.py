"""The coordinator's settings are declared once (`hexgen_service.coordinator_config`): its
command line is generated from them, rendered from them, and the launchers' command lines
are rendered through them.

Every field round-trips (a non-default value rendered and parsed back), ``--help`` lists
the fields' options and nothing else, ``hexgen-flow up``'s and ``up --shards``' coordinator
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

from hexgen_cli.up_shards import _coordinator_args
from hexgen_coordinator.__main__ import parse_args
from hexgen_coordinator.config import CoordinatorConfig, coordinator_argv
from hexgen_flow.errors import ConfigError
from hexgen_launch.cluster_config import (
    SHARDED_ADMISSION,
    LocalClusterConfig,
    coordinator_config,
)
from hexgen_launch.cluster_config import coordinator_argv as up_coordinator_argv
from hexgen_service.coordinator_config import add_coordinator_options
from hexgen_service.settings import from_args, option_of
from hexgen_service.tls import add_tls_options

FIELDS = tuple(f.name for f in dataclasses.fields(CoordinatorConfig))

SECRETS = {"redis_password": "--redis-password-file", "worker_token": "--worker-token-file"}
"""Settings given as a file (never on a command line)."""

NON_DEFAULT: dict[str, Any] = {
    "listen": "127.0.0.1:6001",
    "worker_listen": "127.0.0.1:6002",
    "redis_url": "redis://127.0.0.1:6380/1",
    "redis_prefix": "hf:{1}:",
    "redis_cluster": True,
    "shards": ("hf:{1}:", "hf:{2}:"),
    "advertise": "127.0.0.1:6003",
    "lease_ttl_s": 1.5,
    "cluster": "H100,L40S",
    "model": "llama3.1-8b",
    "calibration": "chess-measured",
    "policy": "fifo",
    "alpha": 0.25,
    "time_scale": 20.0,
    "slo_scale": 2.5,
    "heartbeat_interval_s": 0.25,
    "heartbeat_timeout_s": 4.0,
    "resume_grace_s": 1.0,
    "seed": 7,
    "metrics_listen": "127.0.0.1:6004",
    "metrics_max_tenants": 5,
    "api_keys_file": "/keys.json",
    "tls_cert": "/tls/cert.pem",
    "tls_key": "/tls/key.pem",
    "tls_ca": "/tls/ca.pem",
    "insecure": True,
    "learn_costs": True,
    "cost_journal": "/runs/costs.jsonl",
    "prefix_caching": False,
    "output_lengths": "learned",
    "gc_tuning": False,
    "event_loop": "asyncio",
    "pipelined_redis": False,
    "log_level": "DEBUG",
    "max_call_attempts": 5,
    "retention_s": 60.0,
    "stream_maxlen": 500,
    "session_idle_s": 30.0,
    "admission": "best-effort",
    "admission_slack": 1.5,
    "max_running_queries": 100,
    "max_tenant_queries": 3,
    "max_tenant_prompt_bytes": 1 << 20,
    "redis_memory_limit": 0.5,
    "max_prompt_bytes": 4096,
    "max_request_bytes": 16 << 20,
    "max_output_tokens": 512,
    "max_calls": 16,
    "max_stages": 8,
    "max_id_bytes": 32,
    "max_tenant_bytes": 16,
    "max_slo_s": 600.0,
}
"""A valid value other than the default for every setting but the secrets."""

NEEDS: dict[str, dict[str, object]] = {"cost_journal": {"learn_costs": True}}
"""Settings that are refused without another (``--cost-journal`` needs ``--learn-costs``)."""

BAD: dict[str, tuple[str, str]] = {
    "lease_ttl_s": ("0", "--lease-ttl-s must be > 0"),
    "alpha": ("1.5", "--alpha must be in [0, 1]"),
    "time_scale": ("0", "--time-scale must be > 0"),
    "slo_scale": ("-1", "--slo-scale must be > 0"),
    "metrics_max_tenants": (
        "-1",
        "--metrics-max-tenants must be >= 0 (0: every tenant as 'other')",
    ),
    "max_call_attempts": ("0", "--max-call-attempts must be >= 1"),
    "retention_s": ("0", "--retention-s must be > 0"),
    "stream_maxlen": ("0", "--stream-maxlen must be >= 1"),
    "session_idle_s": ("nan", "--session-idle-s must be > 0"),
    "admission_slack": ("0", "--admission-slack must be > 0"),
    "max_running_queries": ("0", "--max-running-queries must be >= 1"),
    "max_tenant_queries": ("-1", "--max-tenant-queries must be >= 0 (0: no limit)"),
    "max_tenant_prompt_bytes": ("0", "--max-tenant-prompt-bytes must be >= 1"),
    "redis_memory_limit": ("0", "--redis-memory-limit must be in (0, 1]"),
    "max_prompt_bytes": ("0", "--max-prompt-bytes must be >= 1"),
    "max_output_tokens": ("-1", "--max-output-tokens must be >= 0 (0: the models' context)"),
    "max_calls": ("0", "--max-calls must be >= 1"),
    "max_stages": ("0", "--max-stages must be >= 1"),
    "max_id_bytes": ("0", "--max-id-bytes must be >= 1"),
    "max_tenant_bytes": ("0", "--max-tenant-bytes must be >= 1"),
    "max_slo_s": ("0", "--max-slo-s must be > 0"),
}
"""A value each setting with a check refuses, and the message (after ``error: ``)."""


def _flag(name: str) -> str:
    return option_of(CoordinatorConfig, name).flag or "--" + name.replace("_", "-")


def _generated_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_coordinator_options(parser)
    add_tls_options(parser, serves="TLS")
    return parser


def _parse(argv: list[str]) -> CoordinatorConfig:
    return from_args(CoordinatorConfig, _generated_parser().parse_args(argv))


# ------------------------------------------------------------------------ (a) round trips


def test_every_setting_has_a_non_default_value_here() -> None:
    """A new setting must be added to NON_DEFAULT (and so to the round trips below)."""
    assert set(NON_DEFAULT) | set(SECRETS) == set(FIELDS)
    defaults = CoordinatorConfig()
    for name, value in NON_DEFAULT.items():
        assert value != getattr(defaults, name), name


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_setting_renders_and_parses_back(name: str) -> None:
    companions = NEEDS.get(name, {})
    config = CoordinatorConfig(**{name: NON_DEFAULT[name], **companions})
    argv = coordinator_argv(config)
    for companion in companions:  # rendered first, in the settings' order
        assert argv.pop(0) == _flag(companion)
    assert argv[0] in (_flag(name), "--no-" + _flag(name)[2:])  # only what differs
    assert len(argv) == (1 if isinstance(NON_DEFAULT[name], bool) else 2)
    argv = coordinator_argv(config)
    assert _parse(argv) == config


def test_every_setting_at_once_and_the_full_form_round_trip() -> None:
    config = CoordinatorConfig(**NON_DEFAULT)
    assert _parse(coordinator_argv(config)) == config
    assert _parse(coordinator_argv(config, only_changed=False)) == config
    full = coordinator_argv(CoordinatorConfig(), only_changed=False)
    assert "--no-learn-costs" in full and "--gc-tuning" in full
    assert _parse(full) == CoordinatorConfig()
    assert coordinator_argv(CoordinatorConfig()) == []


def test_the_coordinators_own_parser_round_trips_too(tmp_path: Path) -> None:
    """Through ``python -m hexgen_coordinator``'s `parse_args`, with the secrets in files
    (rendered by no one: a command line is readable by every user)."""
    password, token = tmp_path / "password", tmp_path / "token"
    password.write_text("s3cret\n")
    token.write_text("t0ken\n")
    plain = {"api_keys_file": "", "tls_cert": "", "tls_key": "", "tls_ca": ""}  # real files
    config = CoordinatorConfig(**{**NON_DEFAULT, **plain})
    argv = coordinator_argv(config)
    argv += ["--redis-password-file", str(password), "--worker-token-file", str(token)]
    parsed, level = parse_args(argv)
    assert parsed == dataclasses.replace(config, redis_password="s3cret", worker_token="t0ken")
    assert level == "DEBUG"
    with pytest.raises(ValueError, match="is a secret: give --"):
        coordinator_argv(parsed)


# ------------------------------------------------------------------------ (b) --help


def test_every_option_of_the_coordinator_is_a_setting() -> None:
    """``--help`` lists exactly the settings' options (a bool's ``--no-`` form too): none
    is declared by hand beside them."""
    out = subprocess.run(
        [sys.executable, "-m", "hexgen_coordinator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    usage = out.split("\n\n", 1)[0]
    listed = set(re.findall(r"\[(--[a-z0-9-]+)", usage)) | set(
        re.findall(r"\| (--[a-z0-9-]+)", usage)
    )
    expected: set[str] = set()
    defaults = CoordinatorConfig()
    for name in FIELDS:
        expected.add(_flag(name))
        if isinstance(getattr(defaults, name), bool):
            expected.add("--no-" + _flag(name)[2:])
    assert listed == expected


# ------------------------------------------------------------------------ (c) the launchers


def _up_argv(config: LocalClusterConfig, token: Path) -> list[str]:
    argv = up_coordinator_argv(
        config, "127.0.0.1:7001", "redis://127.0.0.1:6379/0", "chess-measured",
        "127.0.0.1:7003", token, "127.0.0.1:7002",
    )  # fmt: skip
    assert argv[:3] == [config.python, "-m", "hexgen_coordinator"]
    return argv[3:]


def _shards_args(**given: Any) -> argparse.Namespace:
    options = {
        "calibration": None, "policy": "hexgen-flow", "alpha": None, "slo_scale": 3.0,
        "admission": None, "learn_costs": False, "retention_s": None, "max_call_attempts": None,
        "output_lengths": None,
    }  # fmt: skip
    return argparse.Namespace(**{**options, **given})


def test_up_renders_its_coordinator_through_the_settings(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    config = LocalClusterConfig(
        cluster="H100,L40S", policy="fifo", alpha=0.3, slo_scale=2.0, time_scale=5.0,
        admission="best-effort", learn_costs=True, retention_s=60.0, max_call_attempts=2,
        redis_prefix="hx:", coordinator_args=("--max-calls", "9"), output_lengths="learned",
    )  # fmt: skip
    parsed, _ = parse_args(_up_argv(config, token))
    assert parsed == CoordinatorConfig(
        listen="127.0.0.1:7001", worker_listen="127.0.0.1:7002",
        redis_prefix="hx:", cluster="H100,L40S", calibration="chess-measured", policy="fifo",
        alpha=0.3, time_scale=5.0, slo_scale=2.0, metrics_listen="127.0.0.1:7003",
        worker_token="t", learn_costs=True, max_call_attempts=2, retention_s=60.0,
        admission="best-effort", max_calls=9, output_lengths="learned",
    )  # fmt: skip
    plain, _ = parse_args(_up_argv(LocalClusterConfig(), token))
    assert plain.admission == "reject" and plain.alpha is None  # the coordinator's defaults


def test_up_shards_renders_its_coordinators_through_the_settings() -> None:
    mesh = ["--listen", "127.0.0.1:7001", "--worker-listen", "127.0.0.1:7002", "--insecure"]
    given = _shards_args(
        policy="fifo", alpha=0.3, slo_scale=2.0, admission="reject", learn_costs=True,
        retention_s=60.0, max_call_attempts=2, calibration="chess-measured",
        output_lengths="learned",
    )  # fmt: skip
    parsed, _ = parse_args([*mesh, *_coordinator_args(given)])
    expected = CoordinatorConfig(
        listen="127.0.0.1:7001", worker_listen="127.0.0.1:7002", insecure=True,
        calibration="chess-measured", policy="fifo", alpha=0.3, slo_scale=2.0,
        admission="reject", learn_costs=True, retention_s=60.0, max_call_attempts=2,
        output_lengths="learned",
    )  # fmt: skip
    assert parsed == expected
    # the one default that differs with shards, said in one place
    plain, _ = parse_args([*mesh, *_coordinator_args(_shards_args())])
    assert plain.admission == SHARDED_ADMISSION == "off"
    assert dataclasses.replace(plain, admission="reject", insecure=False) == CoordinatorConfig(
        listen="127.0.0.1:7001", worker_listen="127.0.0.1:7002"
    )


def test_the_two_launchers_agree_but_for_the_sharded_admission() -> None:
    local = LocalClusterConfig(policy="fifo", alpha=0.5, retention_s=10.0, learn_costs=True)
    one, sharded = coordinator_config(local), coordinator_config(local, sharded=True)
    assert dataclasses.replace(sharded, admission=one.admission) == one
    assert (one.admission, sharded.admission) == ("reject", "off")
    with pytest.raises(ConfigError, match=r"--alpha must be in \[0, 1\]"):
        coordinator_config(LocalClusterConfig(alpha=2.0))


# ------------------------------------------------------------------------ (d) bad values


def test_every_checked_setting_has_a_bad_value_here() -> None:
    checked = {n for n in FIELDS if option_of(CoordinatorConfig, n).check is not None}
    assert set(BAD) == checked


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_one_line_naming_its_flag(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value, message = BAD[name]
    with pytest.raises(SystemExit) as exited:
        parse_args([_flag(name), value])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"hexgen-coordinator: error: {message}\n"
    with pytest.raises(ConfigError, match=re.escape(message)):
        kind: Any = type(getattr(CoordinatorConfig(), name) or 0.0)  # alpha: None
        CoordinatorConfig(**{name: kind(value)})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--alpha", "2"], "--alpha must be in [0, 1]"),
        (["--max-request-bytes", "10"], "--max-request-bytes (10) must be at least"),
        (["--cost-journal", "/tmp/c.jsonl"], "--cost-journal needs --learn-costs"),
        (["--admission", "maybe"], "argument --admission: invalid choice: 'maybe'"),
        (["--max-calls", "x"], "argument --max-calls: invalid int value: 'x'"),
    ],
)
def test_the_coordinator_process_exits_2_with_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_coordinator", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"hexgen-coordinator: error: {message}")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
