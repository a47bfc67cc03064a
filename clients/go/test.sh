#!/usr/bin/env bash
# Build, vet and test the Go client offline, with the Debian-packaged Go toolchain and
# libraries (it installs nothing; see clients/go/README.md for the apt-get line).
#
#   clients/go/test.sh                                   # unit tests; live tests skip
#   HEXGEN_COORDINATOR=127.0.0.1:50051 clients/go/test.sh  # and the live tests of a mesh
#   HEXGEN_COORDINATOR_LIMITED=127.0.0.1:50061 ...          # and those of a coordinator with
#                                                          # --max-running-queries 1, no worker
#   HEXGEN_COORDINATOR_SHARDED=127.0.0.1:P0,127.0.0.1:P1 ...  # and those of a sharded mesh
#                                                          # (`up --shards 2 --spares 0`)
#   HEXGEN_SHARD_FIXTURES='{"loop": ...}' ...               # and the redirect-loop tests: the
#                                                          # line .venv/bin/python
#                                                          # tests/shard_redirect_server.py prints
#                                                          # (it serves until SIGTERM)
#
# Exits non-zero when anything fails. GO_TEST_FLAGS adds flags to `go test` (e.g. -run X).
#
# The offline GOPATH-mode build environment (why and how: gopath.sh, README.md) comes from
# gopath.sh, which tests/test_client_traces.py uses too.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=gopath.sh
source "$HERE/gopath.sh"
hexgen_gopath_enter || exit $?
trap 'rm -rf "$HEXGEN_GOPATH_WORK"' EXIT

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
  echo "== go test ./... (live tests against $HEXGEN_COORDINATOR, limited: ${HEXGEN_COORDINATOR_LIMITED:-unset, those skip})"
else
  echo "== go test ./... (HEXGEN_COORDINATOR unset: the live tests skip; the unit tests run)"
fi
fixtures="unset, their tests skip"
[ -n "${HEXGEN_SHARD_FIXTURES:-}" ] && fixtures="set"
echo "== shards: sharded mesh ${HEXGEN_COORDINATOR_SHARDED:-unset, its test skips}; redirecting servers (HEXGEN_SHARD_FIXTURES) $fixtures"
# shellcheck disable=SC2086
go test -count=1 -v ${GO_TEST_FLAGS:-} ./...
