# The HexGen-Flow services (coordinator, worker with simulated engines, tuner) and the
# hexgen-flow CLI in one image; docker-compose.yml runs each service from it.
#
#   docker build -t hexgen-flow .
#   docker run --rm hexgen-flow hexgen-flow simulate
#
# Two stages: the first builds the project's wheel with the simulator's hot modules compiled
# by mypyc (scripts/compile_core.py --wheel: about 3x the simulated calls per second, results
# byte-identical to Python; the tuner replays traffic in that simulator), the second installs
# it without the compiler. `make test-compiled` tests the same wheel.

# ---------------------------------------------------------------- build: the compiled wheel
FROM python:3.11-slim AS build

# Any gcc compiles it: not pinned to a Debian version, which would break at its next update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# mypyc type-checks the modules it compiles: the core's dependencies, mypy and their stubs.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies']))" \
        > /tmp/core.txt \
    && pip install -r /tmp/core.txt 'mypy>=1.11' types-PyYAML types-tqdm 'setuptools>=68'

COPY src ./src
COPY protos/python ./protos/python
COPY protos/wire ./protos/wire
COPY services ./services
COPY clients ./clients
COPY apps ./apps
COPY scripts/compile_core.py ./scripts/compile_core.py
RUN python scripts/compile_core.py --wheel /wheels

# ---------------------------------------------------------------- the image
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml ./
# The core's dependencies and the mesh extra's (the services need both).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['mesh']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY --from=build /wheels /wheels
RUN pip install --no-deps /wheels/hexgen_flow-*.whl && rm -rf /wheels

# Run as a user without privileges.
RUN useradd --create-home --uid 10001 hexgen
USER hexgen

CMD ["hexgen-flow", "--help"]
