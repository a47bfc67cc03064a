"""Make sure `prometheus` and `promtool` are on PATH for the metrics tests
(tests/test_prometheus_dashboard.py, tests/test_metrics_exposure.py): install Debian's
`prometheus` package with apt-get when they are missing and it can (CI runs as root), and
otherwise say how to. Without them those tests skip, saying why.

Only the binaries are wanted: the package's own service is not needed (the tests start a
Prometheus of their own, on free ports, with the shipped scrape configs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

BINARIES = ("prometheus", "promtool")


def missing() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None]


def main() -> None:
    if not missing():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        sys.exit(
            f"{', '.join(missing())} not found: install them (e.g. `sudo apt-get install "
            "--no-install-recommends prometheus`), or the metrics tests skip"
        )
    print("prometheus not found: installing it with apt-get", file=sys.stderr)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, stdout=subprocess.DEVNULL, check=False, env=env).returncode:
        # a fresh machine's package lists may be missing or stale
        subprocess.run(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL, check=True)
        subprocess.run(install, stdout=subprocess.DEVNULL, check=True, env=env)
    if missing():
        sys.exit(f"installed prometheus, but {', '.join(missing())} is still not on PATH")


if __name__ == "__main__":
    main()
