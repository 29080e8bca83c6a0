"""Names on NATS shared by a storage node (publisher) and the coordinator (consumer).

Subjects, the stream and message ids of the NATS JetStream event transport;
both services import them from here, so neither imports the other.
"""

from __future__ import annotations

from urllib.parse import unquote

from kvmesh.common.errors import InvalidArgument

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_STREAM = "KVMESH_EVENTS"
EVENTS_ROOT = "kvmesh.events"
COMMANDS_ROOT = "kvmesh.commands"
COMMAND_RESULTS_ROOT = "kvmesh.command_results"
#: The subjects of the event stream: one per emitting instance below the root.
EVENTS_SUBJECTS = f"{EVENTS_ROOT}.>"
_SAFE_SUBJECT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def subject_token(instance_id: str) -> str:
    """``instance_id`` as one NATS subject token, reversibly.

    Letters, digits, ``_`` and ``-`` stay; every other byte of the UTF-8 form
    (``.``, ``*``, ``>``, blanks, ``%`` itself) becomes ``%XX``, so distinct
    ids never share a subject and :func:`instance_from_token` inverts it.
    """
    if not instance_id:
        raise InvalidArgument("instance_id must not be empty", field="instance_id")
    if all(c in _SAFE_SUBJECT_CHARS for c in instance_id):
        return instance_id
    out: list[str] = []
    for c in instance_id:
        if c in _SAFE_SUBJECT_CHARS:
            out.append(c)
        else:
            out.extend(f"%{b:02X}" for b in c.encode("utf-8"))
    return "".join(out)


def instance_from_token(token: str) -> str:
    """The instance id a :func:`subject_token` stands for."""
    return unquote(token, errors="strict")


def events_subject(instance_id: str) -> str:
    """``kvmesh.events.<instance>``: where the instance publishes its batches."""
    return f"{EVENTS_ROOT}.{subject_token(instance_id)}"


def commands_subject(instance_id: str) -> str:
    """``kvmesh.commands.<instance>``: coordinator commands to the instance (core NATS)."""
    return f"{COMMANDS_ROOT}.{subject_token(instance_id)}"


def command_results_subject(instance_id: str) -> str:
    """``kvmesh.command_results.<instance>``: the instance's answers to commands."""
    return f"{COMMAND_RESULTS_ROOT}.{subject_token(instance_id)}"


def message_id(instance_id: str, incarnation: int, seq: int) -> str:
    """The ``Nats-Msg-Id`` of one batch: ``<instance>/<incarnation>/<seq>``.

    ``<instance>`` is the :func:`subject_token` form: unique per instance and
    safe inside a header line whatever the id contains.
    """
    return f"{subject_token(instance_id)}/{incarnation}/{seq}"


def nats_error_text(exc: BaseException) -> str:
    """A one-line description of a nats-py error (several have an empty ``str()``)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
