# kvmesh services image: one image, the command picks the service
# (kvmesh coordinator | storage | gateway). CPU build of torch.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kvmesh

# torch first, from the CPU index, so the project's torch==2.13.0 pin is already satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY src ./src
RUN pip install ".[redis,nats,s3]"

# gRPC and /metrics ports of the three services (each can be changed with flags).
EXPOSE 8300 8301 8302 9300 9301 9302
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
