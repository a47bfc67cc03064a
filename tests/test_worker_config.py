"""The worker's settings are declared once (`hexgen_service.worker_config`): its command
line is generated from them, rendered from them, and the launchers' worker command lines
are rendered through them.

Every field round-trips (a non-default value rendered and parsed back), ``--help`` lists
the fields' options and nothing else, ``hexgen-flow up``'s worker command line parses into
the settings it meant, and a bad value is one line naming its flag, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.errors import ConfigError
from hexgen_launch.cluster_config import worker_argv as up_worker_argv
from hexgen_service.settings import option_of
from hexgen_service.tls import add_tls_options
from hexgen_service.worker_config import add_worker_options, worker_config_from_args
from hexgen_worker import cli
from hexgen_worker.cli import build_parser, config_from_args, main
from hexgen_worker.config import WorkerConfig, worker_argv

FIELDS = tuple(f.name for f in dataclasses.fields(WorkerConfig))

SECRETS = {"worker_token": "--worker-token-file"}
"""Settings given as a file (never on a command line)."""

CODE_ONLY: dict[str, Any] = {
    "request_timeout_s": 5.0,
    "backoff_initial_s": 0.5,
    "backoff_max_s": 4.0,
    "jitter_seed": 3,
    "welcome_timeout_s": 10.0,
    "shutdown_grace_s": 0.0,
}
"""Settings with no option (set from code), and a valid value other than the default."""

NON_DEFAULT: dict[str, Any] = {
    "coordinator": "127.0.0.1:6001",
    "extra_coordinators": ("127.0.0.1:6002", "127.0.0.1:6003"),
    "worker_id": "w-7",
    "slot": 3,
    "gpu": "L40S",
    "model": "llama-3.1-8b",
    "calibration": "aiconfigurator",
    "gpus_file": "examples/cpu-1core-cluster.yaml",
    "engine": "openai",
    "engine_model": "prefill-first",
    "prefix_caching": False,
    "kv_cache_tokens": 50_000,
    "max_batch": 16,
    "max_concurrency": 8,
    "max_context_tokens": 4096,
    "openai_url": "http://127.0.0.1:8000",
    "openai_model": "m",
    "openai_api": "chat",
    "openai_priority": True,
    "ignore_eos": False,
    "eos_script": "/runs/eos-script.json",
    "vllm_model": "/models/m",
    "vllm_engine_args": {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 4096},
    "log_level": "DEBUG",
    "metrics_listen": "127.0.0.1:6004",
    "metrics_tls_cert": "/tls/metrics-cert.pem",
    "metrics_tls_key": "/tls/metrics-key.pem",
    "api_keys_file": "/keys.json",
    "insecure": True,
    "tls_ca": "/tls/ca.pem",
    "tls_cert": "/tls/cert.pem",
    "tls_key": "/tls/key.pem",
}
"""A valid value other than the default for every setting on the command line but the
secret (all of them together resolve, too)."""

BAD: dict[str, tuple[str, str]] = {
    "slot": ("-2", "--slot must be >= 0, or -1 for any slot, got -2"),
    "max_batch": ("0", "--max-batch must be >= 1, got 0"),
    "max_concurrency": ("0", "--max-concurrency must be >= 1, got 0"),
    "max_context_tokens": ("-1", "--max-context-tokens must be >= 0, got -1"),
}
"""A value each option with a check refuses, and the message (after ``error: ``)."""

BAD_CODE_ONLY: dict[str, tuple[float, str]] = {
    "request_timeout_s": (0.0, "request_timeout_s must be a finite number > 0, got 0.0"),
    "backoff_initial_s": (float("nan"), "backoff_initial_s must be a finite number > 0, got nan"),
    "backoff_max_s": (-1.0, "backoff_max_s must be a finite number > 0, got -1.0"),
    "welcome_timeout_s": (float("inf"), "welcome_timeout_s must be a finite number > 0, got inf"),
    "shutdown_grace_s": (-0.5, "shutdown_grace_s must be >= 0, got -0.5"),
}
"""The code-only settings' checks name the field (there is no flag)."""

BASE = ["--coordinator", "localhost:50051", "--worker-id", "w1", "--gpu", "A100"]


def _flag(name: str) -> str:
    return option_of(WorkerConfig, name).flag or "--" + name.replace("_", "-")


def _generated_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    add_tls_options(parser, serves=None)
    return parser


def _parse(argv: list[str]) -> WorkerConfig:
    return worker_config_from_args(_generated_parser().parse_args(argv))


# ------------------------------------------------------------------------ (a) round trips


def test_every_setting_has_a_non_default_value_here() -> None:
    """A new setting must be added to NON_DEFAULT (and so to the round trips below)."""
    assert set(NON_DEFAULT) | set(SECRETS) | set(CODE_ONLY) == set(FIELDS)
    defaults = WorkerConfig()
    for name, value in {**NON_DEFAULT, **CODE_ONLY}.items():
        assert value != getattr(defaults, name), name
    for name in CODE_ONLY:
        assert option_of(WorkerConfig, name).code_only, name


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_setting_renders_and_parses_back(name: str) -> None:
    config = WorkerConfig(**{name: NON_DEFAULT[name]})
    argv = worker_argv(config)
    always = worker_argv(WorkerConfig())  # --coordinator, and the required options
    assert always == ["--coordinator", "localhost:50051", "--worker-id", "", "--gpu", "A100"]
    if name not in ("coordinator", "worker_id", "gpu"):  # only what differs, besides
        said = Counter(a for a in argv if a.startswith("--"))
        said.subtract(a for a in always if a.startswith("--"))
        flag = _flag(name)
        assert set(+said) and set(+said) <= {flag, "--no-" + flag[2:]}, argv
    assert _parse(argv) == config


def test_every_setting_at_once_and_the_full_form_round_trip() -> None:
    config = WorkerConfig(**NON_DEFAULT)
    assert _parse(worker_argv(config)) == config
    assert _parse(worker_argv(config, only_changed=False)) == config
    full = worker_argv(WorkerConfig(), only_changed=False)
    assert "--no-openai-priority" in full and "--ignore-eos" in full
    assert _parse(full) == WorkerConfig()


def test_the_workers_own_parser_round_trips_too(tmp_path: Path) -> None:
    """Through ``python -m hexgen_worker``'s parser (resolved), with the token in a file
    (rendered by no one: a command line is readable by every user)."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    script = tmp_path / "eos.json"  # read when the configuration is resolved
    script.write_text('{"q/0.0": 3}')
    # the cli reads the keys file
    config = WorkerConfig(**{**NON_DEFAULT, "api_keys_file": "", "eos_script": str(script)})
    argv = [*worker_argv(config), "--worker-token-file", str(token)]
    parsed = config_from_args(build_parser().parse_args(argv))
    assert parsed == dataclasses.replace(config, worker_token="t0ken").resolved()
    with pytest.raises(ValueError, match="is a secret: give --worker-token-file"):
        worker_argv(parsed)


def test_the_code_only_settings_are_no_options() -> None:
    config = WorkerConfig(**CODE_ONLY)
    assert worker_argv(config) == worker_argv(WorkerConfig())
    assert worker_argv(config, only_changed=False) == worker_argv(
        WorkerConfig(), only_changed=False
    )


# ------------------------------------------------------------------------ (b) --help


def test_every_option_of_the_worker_is_a_setting() -> None:
    """``--help`` lists exactly the settings' options (a bool's ``--no-`` form too, the TLS
    ones of `hexgen_service.tls`): none is declared by hand beside them."""
    out = subprocess.run(
        [sys.executable, "-m", "hexgen_worker", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    usage = out.split("\n\n", 1)[0]
    listed = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", usage))
    expected: set[str] = set()
    for field in dataclasses.fields(WorkerConfig):
        if option_of(WorkerConfig, field.name).code_only:
            continue
        expected.add(_flag(field.name))
        if str(field.type).startswith("bool"):  # bool, bool | None
            expected.add("--no-" + _flag(field.name)[2:])
    assert "--coordinator" in listed and "--vllm-arg" in listed  # spelled by hand (repeated)
    assert listed == expected


# ------------------------------------------------------------------------ (c) the launchers


def test_up_renders_its_workers_through_the_settings() -> None:
    argv = up_worker_argv(
        "/venv/python", "127.0.0.1:7002", 2, "L40S", "llama-3.1-8b", "openai",
        ["--openai-url", "http://127.0.0.1:8000", "--max-batch", "8"], "chess-measured",
    )  # fmt: skip
    assert argv[:3] == ["/venv/python", "-m", "hexgen_worker"]
    parsed = worker_config_from_args(build_parser().parse_args(argv[3:]))
    assert parsed == WorkerConfig(
        coordinator="127.0.0.1:7002", worker_id="local-worker-2", slot=2, gpu="L40S",
        model="llama-3.1-8b", engine="openai", calibration="chess-measured",
        openai_url="http://127.0.0.1:8000", max_batch=8,
    )  # fmt: skip
    # a default mesh's command line, as it always was: the default calibration unsaid
    plain = up_worker_argv(sys.executable, "127.0.0.1:7002", 0, "A100", "llama-3.1-70b")
    assert plain[3:] == [
        "--coordinator", "127.0.0.1:7002", "--worker-id", "local-worker-0", "--slot", "0",
        "--gpu", "A100", "--model", "llama-3.1-70b", "--engine", "simulated",
    ]  # fmt: skip
    default = up_worker_argv(sys.executable, "h:1", 0, "A100", "m", calibration="aiconfigurator")
    assert "--calibration" not in default


def test_the_launcher_refuses_what_the_worker_would() -> None:
    with pytest.raises(ConfigError, match="--slot must be >= 0, or -1 for any slot"):
        up_worker_argv(sys.executable, "127.0.0.1:7002", -3, "A100", "llama-3.1-70b")
    with pytest.raises(ConfigError, match="--engine 'tgi': expected simulated, openai or vllm"):
        up_worker_argv(sys.executable, "127.0.0.1:7002", 0, "A100", "llama-3.1-70b", "tgi")


# ------------------------------------------------------------------------ (d) bad values


def test_every_checked_setting_has_a_bad_value_here() -> None:
    checked = {n for n in FIELDS if option_of(WorkerConfig, n).check is not None}
    assert set(BAD) | set(BAD_CODE_ONLY) == checked
    assert not set(BAD) & set(CODE_ONLY) and set(BAD_CODE_ONLY) <= set(CODE_ONLY)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_one_line_naming_its_flag(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def serve(config: WorkerConfig) -> int:  # a value let through: no worker runs
        return 0

    monkeypatch.setattr(cli, "_serve", serve)
    value, message = BAD[name]
    assert main([*BASE, _flag(name), value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"hexgen-worker: error: {message}\n"
    with pytest.raises(ConfigError, match=re.escape(message)):
        WorkerConfig(**dict[str, Any]({name: int(value)}))


@pytest.mark.parametrize("name", sorted(BAD_CODE_ONLY))
def test_a_bad_code_only_value_names_its_field(name: str) -> None:
    value, message = BAD_CODE_ONLY[name]
    given: dict[str, Any] = {name: value}
    with pytest.raises(ConfigError, match=re.escape(message)):
        WorkerConfig(**given)


def test_a_bad_choice_made_in_code_is_refused_on_the_field() -> None:
    with pytest.raises(ConfigError, match=r"--engine 'tgi': expected simulated, openai or vllm"):
        WorkerConfig(engine="tgi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"--log-level 'LOUD': expected DEBUG, INFO, WARN"):
        WorkerConfig(log_level="LOUD")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
        (["--slot", "x"], "argument --slot: invalid int value: 'x'"),
    ],
)
def test_the_worker_process_exits_2_with_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_worker", *BASE, *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"hexgen-worker: error: {message}")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_a_gpu_type_of_the_cluster_file_resolves_only_with_gpus_file() -> None:
    """A cluster file may define GPU types of its own (examples/cpu-1core-cluster.yaml: one
    CPU core); a worker of that cluster resolves its --gpu with the file's entries."""
    root = Path(__file__).resolve().parents[1]
    base = WorkerConfig(
        worker_id="w",
        gpu="CPU-1core",
        model="smollm2-135m",
        calibration=f"measured:{root}/examples/profiles/smollm2-135m-vllm-cpu-1core.yaml",
    )
    with pytest.raises(ConfigError, match="unknown GPU type 'CPU-1core'"):
        base.resolved()
    config = dataclasses.replace(base, gpus_file=str(root / "examples/cpu-1core-cluster.yaml"))
    resolved = config.resolved()
    assert resolved.gpu == "CPU-1core"
    assert resolved.kv_cache_tokens == config.instance_spec().kv_cache_tokens > 0
