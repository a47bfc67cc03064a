"""Run the Go and TypeScript clients' live tests against a real local mesh (`make
test-clients`).

Starts three meshes at once, `hexgen-flow up` (simulated engines, a private Redis, ports
picked free; plaintext; admission control on, as `up` runs by default), a secured one,
`hexgen-flow up --secure --auth-dir TMP/auth --tenants a,b` (TLS with a certificate of
TMP/auth/ca.pem, API keys of tenants a and b) and a sharded one, `hexgen-flow up --shards 2
--spares 0` (two coordinator shards sharing two simulated workers), and the redirecting
servers of tests/shard_redirect_server.py (a circle of redirects, a chain too long to
follow, a shard without a holder, two shards); reads the
coordinators' addresses and the plaintext mesh's Redis URL from the banners, and starts a
*limited* coordinator on that Redis (its own key prefix, ``--max-running-queries 1``, no
worker: the query it admits stays running, so the next submission is RESOURCE_EXHAUSTED
with a ``retry-after-s`` trailer, and a watch of it never ends by itself). Then it runs
each client's `test.sh` with these set:

- ``HEXGEN_COORDINATOR``, ``HEXGEN_COORDINATOR_LIMITED``: the plaintext mesh's and the
  limited coordinator's addresses;
- ``HEXGEN_COORDINATOR_SECURE``, ``HEXGEN_COORDINATOR_SECURE_AUTH_DIR``: the secured tests
  (a tenant's query runs and reads back; no key is UNAUTHENTICATED, another tenant's key
  NOT_FOUND, SetAlpha with a tenant's key PERMISSION_DENIED; ``HEXGEN_FLOW_API_KEY`` and
  ``HEXGEN_FLOW_TLS_CA`` are removed from the clients' environment, so the plaintext tests
  stay plaintext);
- ``HEXGEN_COORDINATOR_SHARDED``: the sharded mesh's comma list, shard 0's coordinator
  first (workflows of both shards, through one address and through the list, complete);
- ``HEXGEN_SHARD_FIXTURES``: the redirecting servers' JSON line (a redirect loop is the
  client's typed error naming the path; a shard without a holder falls over);

and after the Go client's, `tests/test_client_traces.py` (one trace across the Go client,
the coordinator and a worker; its own `up`); then it stops everything, and exits non-zero
when anything failed. ``--install`` first installs the toolchains a client needs and lacks
(Go, grpc-go and OpenTelemetry Go from Debian's packages with apt-get; Node's packages come
with the client's own ``npm ci``), which is what CI does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hexgen_launch.processes import free_port
from hexgen_service.healthcheck import check

ROOT = Path(__file__).resolve().parents[1]
TRACES_TEST = "tests/test_client_traces.py"
SHARD_FIXTURES = ROOT / "tests" / "shard_redirect_server.py"
LIMITED_PREFIX = "hf-limited:"
SECURE_TENANTS = "a,b"
CREDENTIAL_ENV = ("HEXGEN_FLOW_API_KEY", "HEXGEN_FLOW_TLS_CA")
CLIENTS = {
    "go": ROOT / "clients" / "go" / "test.sh",
    "typescript": ROOT / "clients" / "typescript" / "test.sh",
}
GO_PACKAGES = [
    "golang-go",
    "golang-google-grpc-dev",
    "golang-google-protobuf-dev",
    "golang-github-golang-protobuf-1-5-dev",
    "golang-opentelemetry-otel-dev",
    "protoc-gen-go",  # with the two below: clients/go/test.sh checks the committed stubs
    "protoc-gen-go-grpc",
    "protobuf-compiler",
]


def install_toolchains(names: list[str]) -> None:
    otel = Path("/usr/share/gocode/src/go.opentelemetry.io/otel/sdk")
    if "go" in names and (shutil.which("go") is None or not otel.is_dir()):
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            packages = " ".join(GO_PACKAGES)
            sys.exit(f"test-clients: Go is missing; install: apt-get install {packages}")
        print("test-clients: installing Go and grpc-go from Debian's packages", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *GO_PACKAGES],
            check=True,
            env=env,
        )
    if "typescript" in names and shutil.which("npm") is None:
        sys.exit("test-clients: Node.js and npm are missing (Node 20: apt-get install nodejs npm)")


def launch_mesh(log: Path, auth_dir: Path | None = None) -> subprocess.Popen[str]:
    """`up` (with `auth_dir`: `up --secure` with tenants a and b), started; read its banner
    with `read_banner`.

    The plaintext mesh keeps `up`'s admission control (``--admission reject``), as the mesh
    a user points ``HEXGEN_COORDINATOR`` at does: a live test whose query no idle cluster
    serves within its SLO is refused there (Go's TestLiveCancel asked 820 s of a query that
    needs about 1658 s, and passed only here, where admission was off)."""
    argv = [
        sys.executable, "-m", "hexgen_cli", "up", "--listen", "127.0.0.1:0",
        "--no-tuner", "--no-gateway", "--metrics-listen", "127.0.0.1:0",
        "--time-scale", "50",
    ]  # fmt: skip
    if auth_dir is not None:
        argv += ["--secure", "--auth-dir", str(auth_dir), "--tenants", SECURE_TENANTS]
        argv += ["--admission", "off"]
    with log.open("w") as stderr:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)


def launch_sharded_mesh(log: Path) -> subprocess.Popen[str]:
    """`up --shards 2 --spares 0` on two simulated workers, started; read its banner with
    `read_banner` (its ``coordinator`` row: both coordinators, shard 0's first)."""
    argv = [
        sys.executable, "-m", "hexgen_cli", "up", "--shards", "2", "--spares", "0",
        "--no-tuner", "--no-gateway", "--cluster", "A100,A100", "--time-scale", "50",
        "--admission", "off",
    ]  # fmt: skip
    with log.open("w") as stderr:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)


def start_shard_fixtures(log: Path) -> tuple[subprocess.Popen[str], str]:
    """tests/shard_redirect_server.py's servers, started; and the JSON line naming them."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SHARD_FIXTURES)], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("{"):
        stop(proc)
        sys.exit(f"test-clients: the redirecting servers did not start (see {log})")
    return proc, line


def read_banner(proc: subprocess.Popen[str], log: Path) -> dict[str, str]:
    """The rows of `up`'s banner ("coordinator": "127.0.0.1:PORT", "redis": "redis://..."),
    once it printed them; exits when it does not come up."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    banner: dict[str, str] = {}
    for line in proc.stdout:
        if line.startswith("  ") and len(line.split()) >= 2:
            key, value = line.strip().split("  ", 1)
            banner[key] = value.strip()
        if line.startswith("Ctrl-C"):
            return banner
        if time.monotonic() > deadline:
            break
    proc.kill()
    sys.exit(f"test-clients: the mesh did not come up (see {log})")


def start_limited(redis_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A coordinator that admits one running query at a time and has no worker, on `up`'s
    Redis under its own key prefix; waits until it reports SERVING."""
    address = f"127.0.0.1:{free_port()}"
    argv = [
        sys.executable, "-m", "hexgen_coordinator", "--listen", address,
        "--redis-url", redis_url, "--redis-prefix", LIMITED_PREFIX, "--cluster", "A100",
        "--admission", "off", "--max-running-queries", "1",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while (problem := check(address, timeout_s=1.0)) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            sys.exit(f"test-clients: the limited coordinator did not answer ({problem}; see {log})")
        time.sleep(0.2)
    return proc, address


def stop(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clients", nargs="*", help=f"of {', '.join(CLIENTS)} (default: all)")
    parser.add_argument("--install", action="store_true", help="install missing toolchains")
    args = parser.parse_args()
    names: list[str] = args.clients or list(CLIENTS)
    unknown = sorted(set(names) - set(CLIENTS))
    if unknown:
        parser.error(f"unknown client {unknown[0]!r} (known: {', '.join(CLIENTS)})")
    if args.install:
        install_toolchains(names)
    results = ROOT / "results"
    results.mkdir(exist_ok=True)
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hexgen-test-clients-"))
    auth_dir = scratch / "auth"
    up_log, secure_log = results / "test-clients-up.log", results / "test-clients-up-secure.log"
    sharded_log = results / "test-clients-up-sharded.log"
    proc = launch_mesh(up_log)
    secure_proc = launch_mesh(secure_log, auth_dir)
    sharded_proc = launch_sharded_mesh(sharded_log)
    fixtures_proc: subprocess.Popen[str] | None = None
    failed = []
    try:
        fixtures_proc, fixtures = start_shard_fixtures(results / "test-clients-shard-fixtures.log")
        banner = read_banner(proc, up_log)
        secure = read_banner(secure_proc, secure_log)["coordinator"]
        sharded = read_banner(sharded_proc, sharded_log)["coordinator"]
        coordinator = banner["coordinator"]
        redis_url = banner["redis"].split()[0]
        limited, limited_address = start_limited(redis_url, results / "test-clients-limited.log")
        try:
            env = {
                **{k: v for k, v in os.environ.items() if k not in CREDENTIAL_ENV},
                "HEXGEN_COORDINATOR": coordinator,
                "HEXGEN_COORDINATOR_LIMITED": limited_address,
                "HEXGEN_COORDINATOR_SECURE": secure,
                "HEXGEN_COORDINATOR_SECURE_AUTH_DIR": str(auth_dir),
                "HEXGEN_COORDINATOR_SHARDED": sharded,
                "HEXGEN_SHARD_FIXTURES": fixtures,
            }
            print(
                f"test-clients: meshes up in {time.monotonic() - started:.1f} s: coordinator "
                f"{coordinator}, limited coordinator {limited_address} (redis {redis_url}, "
                f"keys {LIMITED_PREFIX}*), secured coordinator {secure} (TLS, API keys of "
                f"tenants {SECURE_TENANTS} in {auth_dir}), sharded coordinators {sharded}, "
                f"redirecting servers {fixtures}",
                flush=True,
            )
            for name in names:
                t0 = time.monotonic()
                print(f"test-clients: {name} against {coordinator}", flush=True)
                code = subprocess.run(["bash", str(CLIENTS[name])], env=env, check=False)
                print(f"test-clients: {name}: {time.monotonic() - t0:.1f} s", flush=True)
                if code.returncode:
                    failed.append(name)
                if name == "go":
                    t0 = time.monotonic()
                    print(f"test-clients: {TRACES_TEST}", flush=True)
                    traces = subprocess.run(
                        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                         TRACES_TEST],
                        cwd=ROOT, env={**os.environ, "HEXGEN_CLIENT_TRACES_REQUIRED": "1"},
                        check=False,
                    )  # fmt: skip
                    print(f"test-clients: {TRACES_TEST}: {time.monotonic() - t0:.1f} s", flush=True)
                    if traces.returncode:
                        failed.append(TRACES_TEST)
        finally:
            stop(limited)
    finally:
        stop(proc)
        stop(secure_proc)
        stop(sharded_proc)
        if fixtures_proc is not None:
            stop(fixtures_proc)
        shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        print(f"test-clients: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"test-clients: {', '.join(names)} passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
