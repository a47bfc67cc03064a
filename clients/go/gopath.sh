#!/usr/bin/env bash
# The offline GOPATH-mode build environment of the Go client, in one place: test.sh sources
# it, and anything else that builds the client (tests/test_client_traces.py builds
# example/traced) runs a command inside it:
#
#   clients/go/gopath.sh go build -o /tmp/traced ./example/traced
#   clients/go/gopath.sh go env GOPATH
#
# Executed, it sets the environment up, runs the command in the client's folder (reached
# through its import path in a scratch GOPATH), removes the scratch GOPATH and exits with
# the command's status. Sourced, it defines hexgen_gopath_enter, which does the same setup
# in the calling shell (exports, cd) and sets HEXGEN_GOPATH_WORK to the scratch folder for
# the caller to remove.
#
# Why GOPATH mode: Debian's golang-*-dev packages install their sources under
# /usr/share/gocode/src, GOPATH-style, which is how Debian builds Go packages itself. A
# module build cannot use them offline (google.golang.org/grpc's go.mod requires modules
# that are not packaged, and with GOPROXY=off their go.mod files cannot be fetched), so the
# build runs in GOPATH mode: a scratch GOPATH whose src/ holds this folder under its import
# path, with /usr/share/gocode after it.
#
# Exit status 2 (and a line naming the apt-get packages) when go or a library is missing.

HEXGEN_GO_HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HEXGEN_GO_IMPORT_PATH="github.com/hexgen-flow/hexgen-flow/clients/go"
HEXGEN_GO_PACKAGES="golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev golang-opentelemetry-otel-dev"

# hexgen_gopath_check: 0 when go and the packaged libraries are there; 2 and why otherwise.
hexgen_gopath_check() {
  local gocode="${GOCODE:-/usr/share/gocode}" pkg
  if ! command -v go >/dev/null 2>&1; then
    echo "gopath.sh: go not found (apt-get install -y $HEXGEN_GO_PACKAGES)" >&2
    return 2
  fi
  for pkg in google.golang.org/grpc google.golang.org/protobuf go.opentelemetry.io/otel/sdk \
    go.opentelemetry.io/otel/exporters/stdout/stdouttrace; do
    if [ ! -d "$gocode/src/$pkg" ]; then
      echo "gopath.sh: $gocode/src/$pkg missing (apt-get install -y $HEXGEN_GO_PACKAGES)" >&2
      return 2
    fi
  done
}

# hexgen_gopath_enter: check, make the scratch GOPATH, export the environment, cd into the
# client's folder through its import path (Go reads $PWD). Sets HEXGEN_GOPATH_WORK.
hexgen_gopath_enter() {
  hexgen_gopath_check || return $?
  local gocode="${GOCODE:-/usr/share/gocode}"
  HEXGEN_GOPATH_WORK="$(mktemp -d)"
  mkdir -p "$HEXGEN_GOPATH_WORK/src/$(dirname "$HEXGEN_GO_IMPORT_PATH")"
  ln -s "$HEXGEN_GO_HERE" "$HEXGEN_GOPATH_WORK/src/$HEXGEN_GO_IMPORT_PATH"
  export GO111MODULE=off
  export GOPATH="$HEXGEN_GOPATH_WORK:$gocode"
  export GOPROXY=off
  export GOFLAGS="-p=2"
  export GOCACHE="${GOCACHE:-${HOME:-$HEXGEN_GOPATH_WORK}/.cache/go-build}"
  cd "$HEXGEN_GOPATH_WORK/src/$HEXGEN_GO_IMPORT_PATH" || return 2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  if [ $# -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]   (runs COMMAND in the client's GOPATH-mode build environment)" >&2
    exit 2
  fi
  hexgen_gopath_enter || exit $?
  trap 'rm -rf "$HEXGEN_GOPATH_WORK"' EXIT
  "$@"
  exit $?
fi
