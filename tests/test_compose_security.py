"""docker-compose.yml's security: the secured mesh (docs/security-deploy.md). Every
credential is a file-based compose secret from the directory
`hexgen-flow auth init deploy/auth --tenants demo,health` makes, TLS is on every door (mutual
TLS on the workers'), Redis has ACL users only, nothing is published beyond 127.0.0.1, and no
service runs --insecure. Checked in the file, and by running the compose commands as
processes on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from compose_file import (
    AUTH_DIR,
    COMPOSE_FILE,
    LISTENING,
    PUBLISHED,
    TENANTS,
    WORKERS,
    auth_fixture,  # noqa: F401
    compose_doc,
)
from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator.__main__ import parse_args
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_gateway.__main__ import parse_config as gateway_config
from hexgen_launch.processes import ManagedProcess, free_port, stop_processes
from hexgen_service.auth_dir import AuthDir
from hexgen_service.exposure import refuse_unprotected
from hexgen_tuner.__main__ import parse_config as tuner_config
from hexgen_worker.cli import UsageError, build_parser, config_from_args

# ------------------------------------------------------------------------ its security


def _argv(service: dict[str, Any]) -> list[str]:
    """A service's entrypoint and command, one list of words."""
    words: list[str] = []
    for part in ("entrypoint", "command"):
        value = service.get(part) or []
        words += value.split() if isinstance(value, str) else [str(v) for v in value]
    return words


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag=VALUE`` or ``--flag VALUE`` in `argv`, None if absent."""
    for i, word in enumerate(argv):
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def test_every_published_port_is_bound_to_this_machine_only() -> None:
    services = compose_doc()["services"]
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published == PUBLISHED
    for name, ports in published.items():
        for port in ports:
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)
    for name, service in services.items():
        assert "expose" not in service and service.get("network_mode") != "host", name


def test_no_service_runs_insecure_and_each_passes_protected_mode() -> None:
    services = compose_doc()["services"]
    for name, service in services.items():
        assert not any("--insecure" in word for word in _argv(service)), name

    def flags(name: str, *wanted: str) -> list[bool]:
        argv = _argv(services[name])
        return [_flag(argv, f) is not None for f in wanted]

    # What each service checks before it listens (hexgen_service.exposure), as it would
    # run here: a door beyond loopback must be protected.
    coordinator = _argv(services["coordinator"])
    keys, cert, ca, token = flags(
        "coordinator", "--api-keys-file", "--tls-cert", "--tls-ca", "--worker-token-file"
    )
    worker_listen = _flag(coordinator, "--worker-listen")
    assert worker_listen is not None, "workers and clients on one door: refused beyond loopback"
    doors = [
        ("--listen", _flag(coordinator, "--listen"), keys and cert, "keys and TLS"),
        ("--worker-listen", worker_listen, (cert and ca) or token, "mTLS or a token"),
    ]
    tuner_keys, tuner_cert = flags("tuner", "--api-keys-file", "--tls-cert")
    doors.append(
        (
            "--listen",
            _flag(_argv(services["tuner"]), "--listen"),
            tuner_keys and tuner_cert,
            "keys and TLS",
        )
    )
    (gateway_cert,) = flags("gateway", "--tls-cert")
    doors.append(("--listen", _flag(_argv(services["gateway"]), "--listen"), gateway_cert, "HTTPS"))
    for flag, address, protected, needs in doors:
        assert address is not None
        refuse_unprotected(flag, address, protected=protected, insecure=False, needs=needs)


def test_every_door_serves_tls_and_checks_keys() -> None:
    services = compose_doc()["services"]
    for name in LISTENING:
        argv = _argv(services[name])
        assert _flag(argv, "--tls-cert") == "/run/secrets/server-cert", name
        assert _flag(argv, "--tls-key") == "/run/secrets/server-key", name
        assert _flag(argv, "--tls-ca") == "/run/secrets/ca", name
        listen = _flag(argv, "--listen")
        assert listen is not None and listen.startswith("0.0.0.0:"), name
    for name in ("coordinator", "tuner"):  # their doors check API keys
        assert _flag(_argv(services[name]), "--api-keys-file") == "/run/secrets/api-keys"
    # The workers' door: mutual TLS (--tls-ca with a server certificate) and the token.
    coordinator = _argv(services["coordinator"])
    assert _flag(coordinator, "--worker-token-file") == "/run/secrets/worker-token"
    for name in WORKERS:
        argv = _argv(services[name])
        assert _flag(argv, "--tls-ca") == "/run/secrets/ca", name
        assert _flag(argv, "--tls-cert") == "/run/secrets/worker-cert", name
        assert _flag(argv, "--tls-key") == "/run/secrets/worker-key", name
        assert _flag(argv, "--worker-token-file") == "/run/secrets/worker-token", name
    # The tuner calls the coordinator as an operator, over TLS.
    tuner = _argv(services["tuner"])
    assert _flag(tuner, "--api-key-file") == "/run/secrets/tuner-key"
    assert _flag(tuner, "--coordinator") == "coordinator:50051"


def _parsed_commands(doc: dict[str, Any], auth: AuthDir) -> tuple[dict[str, Any], list[str]]:
    """Each hexgen service's compose command read by the service's own parser (the flags
    exist, each value passes its setting's check, the files read, protected mode passes),
    with /run/secrets/NAME as the auth directory's file: the configurations, by service,
    and a line for each command a parser refuses (its one-line error)."""
    files = {
        name: str(auth.path / secret["file"].removeprefix(AUTH_DIR + "/"))
        for name, secret in doc["secrets"].items()
    }

    def argv(name: str) -> list[str]:
        words = doc["services"][name]["command"][3:]
        words = [w.replace("${HEXGEN_TIME_SCALE:-1}", "1") for w in words]
        return [
            re.sub(r"/run/secrets/([A-Za-z0-9_-]+)", lambda m: files[m.group(1)], w) for w in words
        ]

    def worker(words: list[str]) -> Any:
        return config_from_args(build_parser().parse_args(words))

    parsers: dict[str, Callable[[list[str]], Any]] = {
        "coordinator": lambda words: parse_args(words)[0],
        "tuner": tuner_config,
        "gateway": lambda words: gateway_config(words)[0],
        **dict.fromkeys(WORKERS, worker),
    }
    parsed: dict[str, Any] = {}
    refused: list[str] = []
    for name, parse in parsers.items():
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parsed[name] = parse(argv(name))
        except (SystemExit, HexgenFlowError, UsageError) as exc:
            said = stderr.getvalue().strip() or str(exc)
            refused.append(f"{name}: {said.split(': error: ', 1)[-1]}")
    return parsed, refused


def test_every_service_takes_its_command_with_the_auth_directorys_files(auth: AuthDir) -> None:
    """Each service's own parser takes its compose command (`_parsed_commands`)."""
    parsed, refused = _parsed_commands(compose_doc(), auth)
    assert refused == []
    assert parsed["coordinator"].worker_token and parsed["coordinator"].redis_password
    assert parsed["tuner"].listen == "0.0.0.0:50053" and parsed["gateway"].https
    assert [parsed[w].slot for w in WORKERS] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("service", "word", "refusal"),
    [
        ("coordinator", "--admission=maybe", "argument --admission: invalid choice: 'maybe'"),
        ("coordinator", "--max-calls=0", "--max-calls must be >= 1"),
        ("tuner", "--no-such-option=1", "unrecognized arguments: --no-such-option=1"),
        ("tuner", "--period-s=0", "--period-s must be a finite number of seconds > 0"),
        ("gateway", "--default-max-tokens=0", "--default-max-tokens must be from 1 to"),
        ("gateway", "--session-idle-s=soon", "argument --session-idle-s: invalid float value"),
        ("worker-2", "--slot=-5", "--slot must be >= 0, or -1 for any slot, got -5"),
        ("worker-3", "--engines=vllm", "unrecognized arguments: --engines=vllm"),
    ],
)
def test_a_compose_command_with_an_unknown_or_invalid_option_is_refused(
    auth: AuthDir, service: str, word: str, refusal: str
) -> None:
    """The check above can fail: an option a service does not have, or a value its
    setting's check refuses, in a compose command is reported with the parser's line."""
    doc = compose_doc()
    doc["services"][service]["command"].append(word)
    _, refused = _parsed_commands(doc, auth)
    assert len(refused) == 1 and refused[0].startswith(f"{service}: {refusal}"), refused


def test_redis_requires_a_login_and_each_service_has_its_own() -> None:
    services = compose_doc()["services"]
    redis = services["redis"]
    argv = _argv(redis)
    aclfile = _flag(argv, "--aclfile")
    assert aclfile is not None
    assert f"/run/secrets/redis-acl {aclfile}" in " ".join(argv)  # copied from the secret
    assert "redis-acl" in redis["secrets"]
    assert "--requirepass" not in argv and "--protected-mode" not in argv
    check = " ".join(redis["healthcheck"]["test"])
    assert "--user health" in check and "/run/secrets/redis-health-password" in check
    for name, user in (("coordinator", "coordinator"), ("tuner", "tuner")):
        argv = _argv(services[name])
        assert _flag(argv, "--redis-url") == f"redis://{user}@redis:6379/0", name
        password = f"/run/secrets/redis-{user}-password"
        assert _flag(argv, "--redis-password-file") == password, name


def test_the_acl_file_the_auth_dir_makes_turns_the_default_user_off(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    auth.init(TENANTS)
    lines = auth.redis_acl.read_text().splitlines()
    assert "user default off" in lines
    users = {line.split()[1] for line in lines}
    assert users == {"default", "coordinator", "tuner", "health"}
    assert all(" nopass" not in line for line in lines)


def test_every_secret_is_a_file_of_the_auth_directory(tmp_path: Path) -> None:
    doc = compose_doc()
    secrets = doc["secrets"]
    auth = AuthDir(tmp_path / "auth")
    auth.init(TENANTS)
    for name, secret in secrets.items():
        assert set(secret) == {"file"}, name  # not `environment`, not `content`
        assert secret["file"].startswith(AUTH_DIR + "/"), name
        made = auth.path / secret["file"].removeprefix(AUTH_DIR + "/")
        assert made.is_file(), f"{name}: `auth init` does not write {made.name}"
    # Every /run/secrets/NAME a service names is a secret it is given.
    for name, service in doc["services"].items():
        given = set(service.get("secrets", []))
        text = json.dumps(service)
        for used in re.findall(r"/run/secrets/([A-Za-z0-9_-]+)", text):
            assert used in given, (name, used)
            assert used in secrets, (name, used)
    # The CA's key (it signs certificates) and the admin key go to no container.
    files = {s["file"].rsplit("/", 1)[1] for s in secrets.values()}
    assert not files & {"ca.key", "admin.key"}


def test_no_secret_is_written_into_the_file() -> None:
    text = COMPOSE_FILE.read_text()
    assert "hfk_" not in text  # an API key
    assert "BEGIN" not in text  # a PEM
    assert not re.search(r"redis://[^@\s/]*:[^@\s/]*@", text)  # a password in a URL
    for name, service in compose_doc()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            assert not re.search(r"PASS|SECRET|TOKEN|KEY", key, re.IGNORECASE), (name, key)
            assert "/run/secrets" not in str(value), (name, key)


# ------------------------------------------------- the compose commands, as processes


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are not installed",
)
def test_the_compose_commands_run_the_secured_mesh(auth: AuthDir, tmp_path: Path) -> None:
    """Every hexgen service and health check of the compose file, run as processes on this
    machine with the auth directory's files: the compose network's names become localhost
    and its ports free ones, nothing else changes. Redis with the ACL file, the coordinator
    (TLS, keys, mutual TLS and token for workers, its Redis user), the four workers, the
    tuner and the gateway all come up healthy, and the demo tenant runs a query."""
    doc = compose_doc()
    services = doc["services"]
    files = {
        name: str(auth.path / secret["file"].removeprefix(AUTH_DIR + "/"))
        for name, secret in doc["secrets"].items()
    }
    redis_port = free_port()
    shared = {port: free_port() for port in (50051, 50052, 50053, 8000, 9464, 9465)}

    def localize(name: str, word: str) -> str:
        word = re.sub(r"/run/secrets/([A-Za-z0-9_-]+)", lambda m: files[m.group(1)], word)
        word = word.replace("${HEXGEN_TIME_SCALE:-1}", "20").replace("$$", "$")

        def port(m: re.Match[str]) -> str:
            host, number = m.group(1), int(m.group(2))
            local = shared.get(number) or free_port()  # a worker's metrics: its own
            return f"{'127.0.0.1' if host == '0.0.0.0' else 'localhost'}:{local}"

        word = re.sub(r"\b(0\.0\.0\.0|127\.0\.0\.1|coordinator):(\d+)\b", port, word)
        return word.replace("@redis:6379/", f"@127.0.0.1:{redis_port}/")

    def argv(name: str) -> list[str]:
        command = [localize(name, str(w)) for w in services[name]["command"]]
        assert command[0] == "python"
        return [sys.executable, *command[1:]]

    def healthy(name: str) -> bool:
        test = [localize(name, str(w)) for w in services[name]["healthcheck"]["test"]]
        if test[0] == "CMD-SHELL":
            run = ["sh", "-c", test[1].replace("redis-cli ", f"redis-cli -p {redis_port} ")]
        else:
            run = [sys.executable if test[1] == "python" else test[1], *test[2:]]
        done = subprocess.run(run, capture_output=True, timeout=30, check=False)
        return done.returncode == 0

    def wait(name: str, process: ManagedProcess | None, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not healthy(name):
            log = process.log_tail() if process is not None else ""
            assert process is None or process.running, f"{name} exited: {log}"
            assert time.monotonic() < deadline, f"{name} is not healthy: {log}"
            time.sleep(0.3)

    redis_command = [str(w) for w in services["redis"]["command"]]
    aclfile = redis_command.index("--aclfile") + 1
    redis_command[aclfile] = files["redis-acl"]  # what the entrypoint copies it from
    processes = [
        ManagedProcess(
            "redis",
            [*redis_command, "--port", str(redis_port), "--bind", "127.0.0.1",
             "--dir", str(tmp_path), "--appendfsync", "no"],
            tmp_path / "redis.log",
        )
    ]  # fmt: skip
    try:
        processes[0].start()
        wait("redis", processes[0])
        for name in ["coordinator", *WORKERS, "tuner", "gateway"]:
            process = ManagedProcess(name, argv(name), tmp_path / f"{name}.log")
            processes.append(process)
            process.start()
            if name == "coordinator":
                wait(name, process)
        for name, process in zip(
            ["coordinator", *WORKERS, "tuner", "gateway"], processes[1:], strict=True
        ):
            wait(name, process)

        async def run_a_query() -> int:
            query = replace(take_queries(load_trace("trace1"), 1)[0], query_id="compose/q0")
            client = CoordinatorClient(
                f"localhost:{shared[50051]}",
                api_key=auth.tenant_key("demo").read_text().strip(),
                tls_ca=auth.ca,
            )
            async with client:
                async for _ in client.run(query, slo_scale=20.0):
                    pass
                return int((await client.get(query.query_id)).query.state)

        assert asyncio.run(run_a_query()) == coordinator_pb2.QUERY_STATE_SUCCEEDED
    finally:
        stop_processes(processes, 5.0)
