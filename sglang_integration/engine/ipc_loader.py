"""The ``IpcModelLoader`` hooks: declare the engine's layout on ``fetch_state``, obey refusals.

Register (the three pairs of ``HOOKS``), all ``HookType.AROUND``::

    FETCH_TARGET -> around_fetch_from_cache
    SEND_TARGET  -> around_send_msg
    RECV_TARGET  -> around_recv_msg

sglang 0.5.23's ``IpcModelLoader._fetch_from_cache`` (ipc_loader.py:449-580) builds its request
inline and sends it with ``send_msg(sock, {"type": "fetch_state", "config": ...})`` (line 556),
then treats any status but ``ok`` as a config mismatch (lines 559-565). It has no seam for an
extra field or another status, so:

- ``around_fetch_from_cache`` marks "this thread is inside the loader's fetch" (a context
  variable) with the ``expert_layout`` field to send, and records where the weights came from:
  ``None`` from the original means no daemon socket, so the loader falls back to disk
  (ipc_loader.py:110-124; in daemon mode it raises instead);
- ``around_send_msg`` adds ``expert_layout`` to a ``fetch_state`` request sent inside that fetch;
- ``around_recv_msg`` turns a ``layout_refused`` reply received inside that fetch into
  ``LayoutRefusedError`` with the daemon's reason. It is a ``RuntimeError``, which the original
  re-raises untouched (ipc_loader.py:572-573), so the engine fails with that reason and never
  falls back to disk.

``send_msg``/``recv_msg`` are hooked at their binding in ``ipc_loader``; the hook registry also
rebinds every other module's ``from ... import send_msg`` (hook_registry.py:292-303), which is
why the wrappers act only inside the loader's fetch and pass everything else through.

The field (``protocol.FetchLayout``, docs/protocol.md): the engine id only when this rank is
attached, the version the engine adopted at startup, and the digest of the map the engine
routes with now (the global ``ExpertLocationMetadata``). No field without a startup session
(dense model, or the startup hook not installed).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.layout import layout_digest
from layout_ledger.wire import protocol
from sglang_integration.engine.weight_source import WeightSource, record_weight_source

logger = logging.getLogger(__name__)

FETCH_TARGET = "sglang.srt.weight_cache.ipc_loader.IpcModelLoader._fetch_from_cache"
SEND_TARGET = "sglang.srt.weight_cache.ipc_loader.send_msg"
RECV_TARGET = "sglang.srt.weight_cache.ipc_loader.recv_msg"


class LayoutRefusedError(RuntimeError):
    """The daemon refused to serve its weights to this engine's layout (``layout_refused``)."""


@dataclass(frozen=True)
class _Fetch:
    loader: Any  # the IpcModelLoader; it fills in its socket_path inside the fetch
    layout_field: protocol.FetchLayout | None


_FETCH: contextvars.ContextVar[_Fetch | None] = contextvars.ContextVar(
    "expert_layout_fetch", default=None
)


def expert_layout_field() -> protocol.FetchLayout | None:
    """The ``expert_layout`` field this rank sends, or None when it has no layout to declare."""
    from sglang_integration.engine.startup import current_session

    session = current_session()
    if session is None:
        return None
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from sglang_integration.engine.metadata import map_of

    metadata = get_global_expert_location_metadata()
    if metadata is None:
        return None
    return protocol.FetchLayout(
        engine_id=session.engine_id if session.attached else None,
        version=session.version,
        digest=layout_digest(map_of(metadata)),
    )


def around_fetch_from_cache(
    original_fn: Callable[..., Any], loader: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook body for ``IpcModelLoader._fetch_from_cache`` (FETCH_TARGET)."""
    token = _FETCH.set(_Fetch(loader=loader, layout_field=expert_layout_field()))
    try:
        result = original_fn(loader, *args, **kwargs)
    finally:
        _FETCH.reset(token)
    record_weight_source(WeightSource.DISK if result is None else WeightSource.DAEMON)
    return result


def around_send_msg(
    original_fn: Callable[..., Any], sock: Any, obj: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook body for ``send_msg`` as ``ipc_loader`` binds it (SEND_TARGET)."""
    fetch = _FETCH.get()
    if (
        fetch is not None
        and fetch.layout_field is not None
        and isinstance(obj, dict)
        and obj.get("type") == protocol.FETCH_STATE
    ):
        obj = {**obj, protocol.FETCH_LAYOUT_FIELD: fetch.layout_field.to_wire()}
    return original_fn(sock, obj, *args, **kwargs)


def around_recv_msg(original_fn: Callable[..., Any], sock: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook body for ``recv_msg`` as ``ipc_loader`` binds it (RECV_TARGET)."""
    reply = original_fn(sock, *args, **kwargs)
    fetch = _FETCH.get()
    if (
        fetch is not None
        and isinstance(reply, dict)
        and reply.get("status") == protocol.LAYOUT_REFUSED
    ):
        reason = reply.get("reason") or "(the daemon gave no reason)"
        raise LayoutRefusedError(
            f"[IpcModelLoader] The weight cache daemon at {fetch.loader.socket_path} refused "
            f"to serve its weights to this engine's expert layout: {reason}"
        )
    return reply


# (dotted target, AROUND hook body) for the plugin to register.
HOOKS = (
    (FETCH_TARGET, around_fetch_from_cache),
    (SEND_TARGET, around_send_msg),
    (RECV_TARGET, around_recv_msg),
)
