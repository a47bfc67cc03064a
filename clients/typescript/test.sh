#!/usr/bin/env bash
# The TypeScript client's checks: install from the lock file, build (tsc, strict), check that
# src/gen/ matches the protos, run the tests. With HEXGEN_COORDINATOR=HOST:PORT the live
# tests run against that coordinator (and the example runs against it too); with
# HEXGEN_COORDINATOR_LIMITED=HOST:PORT (a coordinator with --max-running-queries 1 and no
# worker, as scripts/test_clients.py starts) the retry-after, deadline and cancellation tests
# run against that one; with HEXGEN_COORDINATOR_SHARDED=HOST:PORT,HOST:PORT (a sharded mesh,
# `up --shards 2 --spares 0`, shard 0's coordinator first) the sharded tests run (and the
# example runs against that list too), and with HEXGEN_SHARD_FIXTURES (the JSON line of
# `python tests/shard_redirect_server.py`) the redirect-loop tests. Without them those tests
# are skipped and only the unit tests (no server) run.
#
#   HEXGEN_COORDINATOR=127.0.0.1:50051 HEXGEN_COORDINATOR_LIMITED=127.0.0.1:50061 clients/typescript/test.sh
#
# Needs Node >= 20 and npm; `npm ci` needs the npm registry (or a warm npm cache).
# Exits non-zero when any step fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

step() { printf '\n== %s\n' "$*"; }

step "npm ci"
npm ci --no-audit --no-fund --loglevel=error

step "build (tsc)"
rm -rf dist
npm run --silent build

step "generate:check (src/gen/ against ../../protos)"
npm run --silent generate:check

fixtures="unset: its tests skipped"
[[ -n "${HEXGEN_SHARD_FIXTURES:-}" ]] && fixtures="set"
step "tests (HEXGEN_COORDINATOR=${HEXGEN_COORDINATOR:-unset: live tests skipped}, HEXGEN_COORDINATOR_LIMITED=${HEXGEN_COORDINATOR_LIMITED:-unset: its tests skipped}, HEXGEN_COORDINATOR_SHARDED=${HEXGEN_COORDINATOR_SHARDED:-unset: its tests skipped}, HEXGEN_SHARD_FIXTURES $fixtures)"
node --test --test-reporter=spec dist/test/*.test.js

if [[ -n "${HEXGEN_COORDINATOR:-}" ]]; then
  step "example (dist/examples/run.js ${HEXGEN_COORDINATOR})"
  node dist/examples/run.js "${HEXGEN_COORDINATOR}" >/dev/null
  echo "example: ok"
fi
if [[ -n "${HEXGEN_COORDINATOR_SHARDED:-}" ]]; then
  step "example against the sharded mesh (dist/examples/run.js ${HEXGEN_COORDINATOR_SHARDED})"
  node dist/examples/run.js "${HEXGEN_COORDINATOR_SHARDED}" >/dev/null
  echo "example: ok"
fi
