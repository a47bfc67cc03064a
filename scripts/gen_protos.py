"""Generate the Python gRPC stubs from protos/ (the one reproducible command).

    python scripts/gen_protos.py            # write protos/python/hexgen_api/v1/*_pb2*.py(i)
    python scripts/gen_protos.py --check    # exit 1 if the committed stubs are stale

Uses the pinned grpcio-tools and mypy-protobuf from the dev extra. The stubs are a package
of their own, `hexgen_api`, not part of the scheduling core: the proto package must be
`hexgen_flow.v1` (buf's PACKAGE_DIRECTORY_MATCH ties it to `protos/hexgen_flow/v1/`), and
protoc writes Python imports from the proto path (`from hexgen_flow.v1 import ...`), with no
option to choose another Python package. So this command generates into a scratch folder
and moves the files to `hexgen_api/v1/`, rewriting only those generated import lines to
`hexgen_api.v1` (the same thing protoletariat does). Everything else is protoc's output,
byte for byte: message and service names, the descriptor's file names and the gRPC method
paths stay `hexgen_flow.v1`, so reflection and clients in other languages see the protos as
written.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = Path("hexgen_flow") / "v1"
"""Where the .proto files are, under PROTO_ROOT (mirrors the proto package)."""
OUT_ROOT = ROOT / "protos" / "python"
PACKAGE_DIR = Path("hexgen_api") / "v1"
"""Where the generated modules go, under OUT_ROOT (the Python package hexgen_api.v1)."""
INIT = '"""Generated gRPC stubs of the hexgen_flow.v1 protos (scripts/gen_protos.py)."""\n'
# Only whole import statements of the proto package, at the start of a line; string
# literals such as '/hexgen_flow.v1.CoordinatorService/SubmitQuery' never match.
_IMPORT = re.compile(r"^(from|import) hexgen_flow\.v1\b", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    # protoc finds the mypy plugins on PATH: the ones installed beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    protos = sorted(PROTO_ROOT.joinpath(PROTO_DIR).glob("*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {PROTO_ROOT / PROTO_DIR}")
    target = out_root / PACKAGE_DIR
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--mypy_out={scratch}",
            f"--mypy_grpc_out={scratch}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        for generated in sorted(Path(scratch, PROTO_DIR).iterdir()):
            text = _IMPORT.sub(r"\1 hexgen_api.v1", generated.read_text())
            (target / generated.name).write_text(text)
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
