"""Make sure a Redis answers on 127.0.0.1:PORT: start `redis-server` if nothing does.

The tests talk to a real Redis. On a machine without the binary this installs it with
apt-get when it can (CI runs as root), and otherwise says how to.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import redis


def answers(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=6379)
    port = parser.parse_args().port
    if answers(port):
        return
    if shutil.which("redis-server") is None:
        if shutil.which("apt-get") and os.geteuid() == 0:
            print("redis-server not found: installing it with apt-get", file=sys.stderr)
            install = ["apt-get", "install", "-y", "-q", "redis-server"]
            if subprocess.run(install, stdout=subprocess.DEVNULL, check=False).returncode:
                # a fresh machine's package lists may be missing or stale
                subprocess.run(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL, check=True)
                subprocess.run(install, stdout=subprocess.DEVNULL, check=True)
        else:
            sys.exit(
                "redis-server not found: install it (e.g. `sudo apt-get install "
                "redis-server`) or start a Redis on port " + str(port)
            )
    subprocess.run(
        [
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        check=True,
    )
    for _ in range(50):
        if answers(port):
            print(f"started redis-server on port {port}", file=sys.stderr)
            return
        time.sleep(0.1)
    sys.exit(f"redis-server did not answer on port {port}")


if __name__ == "__main__":
    main()
