"""Run the Go and TypeScript clients' live tests against a real local mesh (`make
test-clients`).

Starts `hexgen-flow up` (simulated engines, a private Redis, ports picked free), reads the
coordinator's address from its banner, runs each client's `test.sh` with
``HEXGEN_COORDINATOR`` set to it, stops the mesh, and exits non-zero when any client
failed. ``--install`` first installs the toolchains a client needs and lacks (Go and
grpc-go from Debian's packages with apt-get; Node's packages come with the client's own
``npm ci``), which is what CI does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = {
    "go": ROOT / "clients" / "go" / "test.sh",
    "typescript": ROOT / "clients" / "typescript" / "test.sh",
}
GO_PACKAGES = [
    "golang-go",
    "golang-google-grpc-dev",
    "golang-google-protobuf-dev",
    "golang-github-golang-protobuf-1-5-dev",
    "protoc-gen-go-grpc",
    "protobuf-compiler",
]


def install_toolchains(names: list[str]) -> None:
    if "go" in names and shutil.which("go") is None:
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


def start_mesh(log: Path) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable, "-m", "hexgen_cli", "up", "--listen", "127.0.0.1:0",
        "--no-tuner", "--no-gateway", "--metrics-listen", "127.0.0.1:0",
        "--time-scale", "50", "--admission", "off",
    ]  # fmt: skip
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    coordinator = ""
    for line in proc.stdout:
        if line.strip().startswith("coordinator"):
            coordinator = line.split()[1]
        if line.startswith("Ctrl-C"):
            return proc, coordinator
        if time.monotonic() > deadline:
            break
    proc.kill()
    sys.exit(f"test-clients: the mesh did not come up (see {log})")


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
    log = ROOT / "results" / "test-clients-up.log"
    log.parent.mkdir(exist_ok=True)
    proc, coordinator = start_mesh(log)
    failed = []
    try:
        for name in names:
            print(f"test-clients: {name} against {coordinator}", flush=True)
            env = {**os.environ, "HEXGEN_COORDINATOR": coordinator}
            if subprocess.run(["bash", str(CLIENTS[name])], env=env, check=False).returncode:
                failed.append(name)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    if failed:
        print(f"test-clients: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"test-clients: {', '.join(names)} passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
