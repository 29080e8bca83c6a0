#!/bin/sh
# kvmesh-vllm-serve ARGS...: vLLM's OpenAI-compatible server, CPU build, for containers.
#
#   kvmesh-vllm-serve --model M --port 8000 --kv-transfer-config '{"kv_connector": ...}'
#
# Runs `python -m vllm.entrypoints.openai.api_server ARGS...` (the `vllm` script of the
# CPU build, vllm-cpu, does not start). With kvmesh's connector set, vLLM 0.32 binds its
# worker's threads to a single core unless VLLM_CPU_OMP_THREADS_BIND says otherwise:
# when it is unset, this binds them to every core the container may use (nproc honours
# the container's cpuset). Set it yourself to share the cores with other work, or where
# a CPU quota (not a cpuset) limits the container.
# The image of the compose `vllm` profile installs this as kvmesh-vllm-serve.
set -eu

if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    echo "kvmesh-vllm-serve: vLLM is not installed in this image (build it with KVMESH_VLLM=1)" >&2
    exit 2
fi

if [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
    VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))"
    export VLLM_CPU_OMP_THREADS_BIND
fi

exec python -m vllm.entrypoints.openai.api_server "$@"
