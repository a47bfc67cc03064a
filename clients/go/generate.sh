#!/usr/bin/env bash
# Generate the Go stubs of protos/hexgen_flow/v1/*.proto into clients/go/hexgenflowv1/
# (the one reproducible command; the output is committed).
#
#   clients/go/generate.sh            # (re)write clients/go/hexgenflowv1/*.pb.go
#   clients/go/generate.sh --check    # exit 1 if the committed stubs are stale
#
# Tools (Debian bookworm packages, no network needed):
#   apt-get install -y protobuf-compiler protoc-gen-go protoc-gen-go-grpc
# The versions are pinned below because protoc-gen-go writes them into every file's header:
# another version would make the check fail on the header alone, so it is refused up front.
# The Go package comes from each proto's `option go_package`; `module=` strips the module
# path so the files land under clients/go/ whatever the working directory.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODULE="github.com/hexgen-flow/hexgen-flow/clients/go"
PKG_DIR="hexgenflowv1"
PROTOC_VERSION="libprotoc 3.21.12"
PROTOC_GEN_GO_VERSION="protoc-gen-go v1.28.1"
PROTOC_GEN_GO_GRPC_VERSION="protoc-gen-go-grpc 1.0"

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

need() {  # need TOOL EXPECTED_VERSION
  local tool="$1" want="$2" got
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "generate.sh: $tool not found (apt-get install -y protobuf-compiler protoc-gen-go protoc-gen-go-grpc)" >&2
    exit 2
  fi
  got="$("$tool" --version 2>&1 | head -n1)"
  if [ "$got" != "$want" ]; then
    echo "generate.sh: $tool is '$got', the committed stubs come from '$want'" >&2
    exit 2
  fi
}
need protoc "$PROTOC_VERSION"
need protoc-gen-go "$PROTOC_GEN_GO_VERSION"
need protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

cd "$ROOT/protos"
protos=(hexgen_flow/v1/*.proto)
protoc -I . \
  --go_out="$scratch" --go_opt="module=$MODULE" \
  --go-grpc_out="$scratch" --go-grpc_opt="module=$MODULE" \
  "${protos[@]}"

if [ ! -d "$scratch/$PKG_DIR" ]; then
  echo "generate.sh: protoc wrote nothing under $PKG_DIR (is go_package set in every proto?)" >&2
  exit 2
fi

if [ "$check" = 1 ]; then
  if diff -r "$scratch/$PKG_DIR" "$HERE/$PKG_DIR" >"$scratch/diff.txt" 2>&1; then
    echo "Go stubs are up to date"
    exit 0
  fi
  head -n 40 "$scratch/diff.txt" >&2
  echo "clients/go/$PKG_DIR is stale: run clients/go/generate.sh" >&2
  exit 1
fi

rm -rf "${HERE:?}/$PKG_DIR"
mkdir -p "$HERE/$PKG_DIR"
cp "$scratch/$PKG_DIR"/*.go "$HERE/$PKG_DIR/"
ls "$HERE/$PKG_DIR" | sed "s|^|clients/go/$PKG_DIR/|"
