"""Real vLLM as an engine of kvmesh's tests, benchmark and demo: each run a fresh process.

:mod:`.model` makes a tiny random-weight Llama locally (no download),
:mod:`.worker` is one vLLM process (``python -m kvmesh.engine.vllm.worker SPEC``)
and :mod:`.runner` starts it and reads its results. Importing this package
imports neither vLLM nor torch; the worker process does.
"""
