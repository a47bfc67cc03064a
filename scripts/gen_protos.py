"""Generate the Python gRPC stubs from protos/ (the one reproducible command).

    python scripts/gen_protos.py            # write src/hexgen_flow/v1/*_pb2*.py(i)
    python scripts/gen_protos.py --check    # exit 1 if the committed stubs are stale

Uses the pinned grpcio-tools and mypy-protobuf from the dev extra; the output mirrors the
proto package (hexgen_flow.v1), so generated imports are absolute and never hand-patched.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "src"
PACKAGE_DIR = Path("hexgen_flow") / "v1"
INIT = '"""Generated gRPC stubs of the hexgen_flow.v1 protos (scripts/gen_protos.py)."""\n'


def generate(out_root: Path) -> list[Path]:
    # protoc finds the mypy plugins on PATH: the ones installed beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    protos = sorted(PROTO_ROOT.joinpath(PACKAGE_DIR).glob("*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    target = out_root / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    (target / "__init__.py").write_text(INIT)
    return sorted(p for p in target.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(OUT_ROOT / PACKAGE_DIR, ignore_errors=True)
        for path in generate(OUT_ROOT):
            print(path.relative_to(ROOT))
        return
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = OUT_ROOT / PACKAGE_DIR
        names = {p.name for p in fresh}
        stale = [
            p.name
            for p in fresh
            if not (committed / p.name).is_file() or not filecmp.cmp(p, committed / p.name, False)
        ]
        extra = (
            [
                p.name
                for p in committed.iterdir()
                if p.is_file() and p.name not in names and not p.name.startswith(".")
            ]
            if committed.is_dir()
            else []
        )
    if stale or extra:
        sys.exit(
            "generated stubs are stale: "
            + ", ".join(stale + extra)
            + "; run `python scripts/gen_protos.py` and commit the result"
        )
    print("generated stubs are up to date")


if __name__ == "__main__":
    main()
