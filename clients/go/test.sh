#!/usr/bin/env bash
# Build, vet and test the Go client offline, with the Debian-packaged Go toolchain and
# libraries (it installs nothing; see clients/go/README.md for the apt-get line).
#
#   clients/go/test.sh                                   # unit tests; live tests skip
#   HEXGEN_COORDINATOR=127.0.0.1:50051 clients/go/test.sh  # and the live tests
#
# Exits non-zero when anything fails. GO_TEST_FLAGS adds flags to `go test` (e.g. -run X).
#
# How the offline build works: Debian's golang-*-dev packages install their sources under
# /usr/share/gocode/src, GOPATH-style, which is how Debian builds Go packages itself. A
# module build cannot use them offline (google.golang.org/grpc's go.mod requires modules
# that are not packaged, and with GOPROXY=off their go.mod files cannot be fetched), so
# this script builds in GOPATH mode: a scratch GOPATH whose src/ holds this folder under
# its import path, with /usr/share/gocode after it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMPORT_PATH="github.com/hexgen-flow/hexgen-flow/clients/go"
GOCODE="${GOCODE:-/usr/share/gocode}"

if ! command -v go >/dev/null 2>&1; then
  echo "test.sh: go not found (apt-get install -y golang-go golang-google-grpc-dev golang-google-protobuf-dev)" >&2
  exit 2
fi
for pkg in google.golang.org/grpc google.golang.org/protobuf; do
  if [ ! -d "$GOCODE/src/$pkg" ]; then
    echo "test.sh: $GOCODE/src/$pkg missing (apt-get install -y golang-google-grpc-dev golang-google-protobuf-dev)" >&2
    exit 2
  fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/$(dirname "$IMPORT_PATH")"
ln -s "$HERE" "$work/src/$IMPORT_PATH"

export GO111MODULE=off
export GOPATH="$work:$GOCODE"
export GOPROXY=off
export GOFLAGS="-p=2"
export GOCACHE="${GOCACHE:-${HOME:-$work}/.cache/go-build}"
cd "$work/src/$IMPORT_PATH"

echo "== go $(go version | awk '{print $3}'), GOPATH=$GOPATH, GO111MODULE=off"
echo "== gofmt"
unformatted="$(gofmt -l hexgenflow example hexgenflowv1)"
if [ -n "$unformatted" ]; then
  echo "not gofmt-formatted:" >&2
  echo "$unformatted" >&2
  exit 1
fi
echo "== go build ./..."
go build ./...
echo "== go vet ./..."
go vet ./...
if command -v protoc >/dev/null 2>&1 && command -v protoc-gen-go >/dev/null 2>&1 \
  && command -v protoc-gen-go-grpc >/dev/null 2>&1; then
  echo "== generate.sh --check"
  "$HERE/generate.sh" --check
else
  echo "== generate.sh --check: skipped (protoc, protoc-gen-go or protoc-gen-go-grpc missing)"
fi
if [ -n "${HEXGEN_COORDINATOR:-}" ]; then
  echo "== go test ./... (live tests against $HEXGEN_COORDINATOR)"
else
  echo "== go test ./... (HEXGEN_COORDINATOR unset: the live tests skip)"
fi
# shellcheck disable=SC2086
go test -count=1 -v ${GO_TEST_FLAGS:-} ./...
