"""What one request may ask of kvmesh (docs/vllm.md, "Per-request switches").

An engine hands the connector a mapping of per-request transfer parameters
(vLLM: ``kv_transfer_params``, a field of its OpenAI requests, or
``SamplingParams.extra_args["kv_transfer_params"]`` offline); other
connectors keep their own keys there. kvmesh reads only ``"kvmesh"``::

    {"kvmesh": {"lookup": false, "store": false}}

- ``lookup: false``: the prompt is computed without asking kvmesh (vLLM's
  own prefix cache still counts);
- ``store: false``: nothing of the prompt is stored in kvmesh.

Both default to true. The connector cannot refuse a request, so an entry it
cannot read (not a mapping, an unknown key, a value that is not a JSON
boolean) is logged once per request and keeps kvmesh out of that request
entirely: computing a prompt is never wrong, and a prompt someone may have
asked not to keep is not kept.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: The key of kvmesh's entry in an engine's per-request transfer parameters.
KEY = "kvmesh"


@dataclass(frozen=True)
class RequestOptions:
    """Whether a request is looked up in kvmesh, and whether it is stored there."""

    lookup: bool = True
    store: bool = True


DEFAULT = RequestOptions()
#: What an unreadable entry gets: kvmesh stays out of the request.
OFF = RequestOptions(lookup=False, store=False)


def request_options(params: object, request_id: str) -> RequestOptions:
    """The request's switches read from its transfer parameters (None: the defaults)."""
    if params is None:
        return DEFAULT
    if not isinstance(params, Mapping):
        return _unreadable(request_id, f"its transfer parameters are a {type(params).__name__}")
    entry = params.get(KEY)
    if entry is None:
        return DEFAULT
    if not isinstance(entry, Mapping):
        return _unreadable(request_id, f'"{KEY}" is a {type(entry).__name__}, not a mapping')
    unknown = sorted(str(k) for k in entry if k not in ("lookup", "store"))
    if unknown:
        return _unreadable(
            request_id, f'"{KEY}" has unknown key(s) {", ".join(unknown)} (known: lookup, store)'
        )
    values = {}
    for name in ("lookup", "store"):
        value = entry.get(name, True)
        if not isinstance(value, bool):
            return _unreadable(request_id, f'"{KEY}.{name}" is {value!r}, not true or false')
        values[name] = value
    return RequestOptions(**values)


def _unreadable(request_id: str, why: str) -> RequestOptions:
    logger.warning(
        "kvmesh: request %s: %s; kvmesh is neither looked up nor stored for it", request_id, why
    )
    return OFF
