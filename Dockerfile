# The HexGen-Flow services (coordinator, worker with simulated engines, tuner) and the
# hexgen-flow CLI in one image; docker-compose.yml runs each service from it.
#
#   docker build -t hexgen-flow .
#   docker run --rm hexgen-flow hexgen-flow simulate
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml README.md ./
# The core's dependencies and the mesh extra's (the services need both).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['mesh']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY src ./src
COPY protos/python ./protos/python
COPY protos/wire ./protos/wire
COPY services ./services
COPY clients ./clients
COPY apps ./apps
RUN pip install --no-deps . && rm -rf /app/build

# Run as a user without privileges.
RUN useradd --create-home --uid 10001 hexgen
USER hexgen

CMD ["hexgen-flow", "--help"]
