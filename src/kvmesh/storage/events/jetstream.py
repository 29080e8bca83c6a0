"""The NATS wire of the event pipeline: the JetStream stream of cache events, and commands.

Shared by the node's :mod:`~kvmesh.storage.events.nats_transport` and the
coordinator's :mod:`kvmesh.coordinator.nats_source` (subject names are in
:mod:`kvmesh.common.nats_names`):

* stream ``KVMESH_EVENTS`` (configurable) over subjects ``kvmesh.events.>``,
  file storage, limits retention (max age 24 h by default), created by the
  first node that finds it missing (:func:`ensure_stream`);
* each batch is the serialized ``kvmesh.events.v1.CacheEventBatch``
  published to ``kvmesh.events.<instance>`` with header ``Nats-Msg-Id:
  <instance_id>/<incarnation>/<seq>`` (:data:`MSG_ID_HEADER`), so
  JetStream's own duplicate window drops a resend whose first copy was
  stored but whose PubAck was lost, and ``Nats-Expected-Stream`` so a
  misconfigured server that routes the subject to another stream refuses
  it; :func:`puback_error` reads JetStream's answer;
* coordinator commands arrive as serialized
  ``kvmesh.coordinator.v1.NodeCommand`` on core-NATS subject
  ``kvmesh.commands.<instance>``; the node answers each with a serialized
  ``CommandResult`` on ``kvmesh.command_results.<instance>`` (best effort:
  the command's effects come back as cache events in the stream, which is
  what the coordinator relies on).

``<instance>`` is :func:`~kvmesh.common.nats_names.subject_token` of the
instance id: NATS subjects cannot carry ``.``, ``*``, ``>`` or blanks inside
one token.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.nats_names import DEFAULT_STREAM, EVENTS_SUBJECTS

logger = logging.getLogger(__name__)

__all__ = [
    "EXPECTED_STREAM_HEADER",
    "MSG_ID_HEADER",
    "NO_RESPONDERS",
    "STATUS_HEADER",
    "StreamSettings",
    "ensure_stream",
    "puback_error",
    "puback_is_duplicate",
]

MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
#: A status header on a reply: "503" means no JetStream stream answered the subject.
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"
#: JetStream's error code for "stream name already in use" (a creation race).
_STREAM_NAME_IN_USE = 10058


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """The JetStream stream of cache events, as a node creates it when it is missing.

    ``max_age_s`` bounds how far back the coordinator can replay (a
    coordinator down longer than that, or restored from an older checkpoint,
    sees a seq gap); ``max_bytes`` 0 means no size limit. ``duplicate_window_s``
    is how long JetStream remembers a ``Nats-Msg-Id``. An existing stream is
    used as it is (the first creator's settings win).
    """

    name: str = DEFAULT_STREAM
    max_age_s: float = 24 * 3600.0
    max_bytes: int = 0
    duplicate_window_s: float = 120.0
    replicas: int = 1

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ".*> \t\r\n/\\"):
            raise InvalidArgument(
                "stream name must be non-empty without '.', '*', '>', '/', '\\' or blanks",
                field="stream",
            )
        if not self.max_age_s >= 0.0:
            raise InvalidArgument("max_age_s must be >= 0 (0 = no limit)", field="max_age_s")
        if self.max_bytes < 0:
            raise InvalidArgument("max_bytes must be >= 0 (0 = no limit)", field="max_bytes")
        if not self.duplicate_window_s > 0.0:
            raise InvalidArgument("duplicate_window_s must be > 0", field="duplicate_window_s")
        if self.replicas < 1:
            raise InvalidArgument("replicas must be >= 1", field="replicas")

    def stream_config(self) -> js_api.StreamConfig:
        """The JetStream configuration of a new stream."""
        # The duplicate window may not exceed the max age (the server refuses it).
        window = self.duplicate_window_s
        if self.max_age_s:
            window = min(window, self.max_age_s)
        return js_api.StreamConfig(
            name=self.name,
            description="kvmesh cache events (kvmesh.events.<instance>)",
            subjects=[EVENTS_SUBJECTS],
            retention=js_api.RetentionPolicy.LIMITS,
            discard=js_api.DiscardPolicy.OLD,
            storage=js_api.StorageType.FILE,
            max_age=self.max_age_s or None,
            max_bytes=self.max_bytes or -1,
            duplicate_window=window,
            num_replicas=self.replicas,
        )


async def ensure_stream(js: JetStreamContext, settings: StreamSettings) -> js_api.StreamInfo:
    """The stream's info, creating it with ``settings`` when it does not exist.

    Two nodes racing to create it both succeed (the loser reads the winner's).
    A stream of that name that does not capture ``kvmesh.events.>`` is logged:
    publishes would then be refused ("expected stream does not match").
    """
    try:
        info = await js.stream_info(settings.name)
    except nats.js.errors.NotFoundError:
        try:
            info = await js.add_stream(settings.stream_config())
            logger.info(
                "created JetStream stream %s (%s, max age %gs)",
                settings.name,
                EVENTS_SUBJECTS,
                settings.max_age_s,
            )
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise  # e.g. its subjects overlap another stream's
            # Created meanwhile by another node.
            info = await js.stream_info(settings.name)
    subjects = info.config.subjects or []
    if EVENTS_SUBJECTS not in subjects:
        logger.warning(
            "JetStream stream %s has subjects %s, not %s: cache events will not land in it",
            settings.name,
            subjects,
            EVENTS_SUBJECTS,
        )
    return info


# --------------------------------------------------------------------------------------
# PubAcks
# --------------------------------------------------------------------------------------


def _puback_json(msg: Msg) -> dict[str, Any]:
    try:
        parsed = json.loads(msg.data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def puback_error(msg: Msg) -> str | None:
    """Why JetStream did not store the published message, or None for a good PubAck."""
    headers = msg.headers or {}
    status = headers.get(STATUS_HEADER)
    if status == NO_RESPONDERS:
        return "no stream captures the subject (503 no responders)"
    if status:
        return f"status {status} {headers.get('Description', '')}".strip()
    resp = _puback_json(msg)
    if not resp:
        return f"unreadable PubAck {msg.data[:200]!r}"
    error = resp.get("error")
    if error:
        if isinstance(error, dict):
            return f"{error.get('code')} {error.get('description', '')}".strip()
        return str(error)
    if "seq" not in resp:
        return f"PubAck without a sequence {msg.data[:200]!r}"
    return None


def puback_is_duplicate(msg: Msg) -> bool:
    """True when a good PubAck says the duplicate window recognised the message."""
    return bool(_puback_json(msg).get("duplicate"))
