# kvmesh image: one image, the command picks what runs —
#   kvmesh coordinator | storage | gateway | node | up | status | demo | bench
# CPU build of torch (the demo's transformer and the engine-side kernels need it).
#
# Build context: the repository root, filtered by .dockerignore (no .venv, .git or
# caches). Everything the CLI imports is the one package under src/kvmesh
# (api, common, rpc, kernels, the three services, connector, engine, node, cli,
# bench), installed from pyproject.toml below.
#
# The native copy kernel (src/kvmesh/kernels/_native/ntcopy.c) is compiled with the
# image's C compiler at build time, into KVMESH_NATIVE_CACHE, and checked to load:
# without it a storage node copies with NumPy at about half the speed. The compiler
# stays in the image on purpose: the kernel's cache key includes the compiler's
# version, so a service finds the prebuilt library only where the compiler that
# built it is present (and a rebuilt kernel source is compiled on first use).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_NATIVE_CACHE=/opt/kvmesh/native

# gcc and the C library headers: the native copy kernel is built with them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvmesh

# torch first, from the CPU index, so the project's torch==2.13.0 pin is already satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The package and what its build reads (pyproject names README.md as the readme).
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[redis,nats,s3]"

# The services run as an unprivileged user, which owns the kernel cache and /data.
RUN useradd --system --uid 10001 --create-home --home-dir /home/kvmesh kvmesh \
    && mkdir -p /data "$KVMESH_NATIVE_CACHE" \
    && chown kvmesh:kvmesh /data "$KVMESH_NATIVE_CACHE" \
    && chmod 700 "$KVMESH_NATIVE_CACHE"
USER kvmesh

# Build the native copy kernel now and fail the build unless it loads; then check
# that every command's modules import (demo and bench included).
RUN python -c "from kvmesh.kernels import native; lib = native.load(); print('copy kernel:', native.status()); raise SystemExit(0 if lib is not None else 1)" \
    && python -c "import kvmesh.cli.main, kvmesh.cli.demo, kvmesh.cli.fleet, kvmesh.cli.status, kvmesh.coordinator.app, kvmesh.storage.app, kvmesh.gateway.app, kvmesh.node.app, kvmesh.connector, kvmesh.engine" \
    && kvmesh --version \
    && kvmesh demo --help > /dev/null \
    && kvmesh bench --help > /dev/null

# Health probe for orchestrators (docker-compose healthchecks): exit 0 only on SERVING.
# (COPY --chmod needs BuildKit, docker build's default builder.)
COPY --chmod=755 deploy/grpc_health_check.py /usr/local/bin/kvmesh-health

# gRPC and /metrics ports of the three services (each can be changed with flags).
EXPOSE 8300 8301 8302 9300 9301 9302
VOLUME ["/data"]
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
