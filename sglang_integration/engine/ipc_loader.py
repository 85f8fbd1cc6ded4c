"""The ``IpcModelLoader`` hooks: declare the engine's layout on ``fetch_state``, obey refusals.

sglang's ``IpcModelLoader._fetch_from_cache`` builds its request inline, sends it with
``send_msg``, and treats any status but ``ok`` as a config mismatch (``UPSTREAM_LINES``). It
has no seam for an extra field or another status, so three hooks (``HOOKS``, all
``HookType.AROUND``) work together: the fetch marks "this thread is inside the loader's
fetch", and only inside it ``send_msg`` adds the ``expert_layout`` field and ``recv_msg`` turns
a ``layout_refused`` reply into ``LayoutRefusedError``.

The field (``protocol.FetchLayout``, docs/protocol.md): the engine id only when this rank is
attached, the version the engine adopted at startup, and the digest of the map the engine
routes with now (the global ``ExpertLocationMetadata``; while it converges, its daemon's digest).
No field without a startup session
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
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

FETCH_TARGET = "sglang.srt.weight_cache.ipc_loader.IpcModelLoader._fetch_from_cache"
SEND_TARGET = "sglang.srt.weight_cache.ipc_loader.send_msg"
RECV_TARGET = "sglang.srt.weight_cache.ipc_loader.recv_msg"

_LOADER = "srt/weight_cache/ipc_loader.py"
# The lines of sglang these hooks rely on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(_LOADER, 449, "def _fetch_from_cache(self", "the fetch hook's target"),
    UpstreamLine(
        _LOADER,
        556,
        'send_msg(sock, {"type": "fetch_state", "config": engine_config.to_dict()})',
        "the request, built inline: the send hook adds the field",
    ),
    UpstreamLine(
        _LOADER,
        559,
        'if result.get("status") != "ok":',
        "any other status reads as a config mismatch: the receive hook raises first",
    ),
    UpstreamLine(
        _LOADER,
        572,
        "except RuntimeError:",
        "a RuntimeError (LayoutRefusedError) is re-raised untouched, no disk fallback",
    ),
    UpstreamLine(_LOADER, 573, "raise", "the same"),
    UpstreamLine(
        _LOADER,
        110,
        "if cache_data is None:",
        "the fetch returns None without a daemon socket: weights from disk",
    ),
    UpstreamLine(
        _LOADER,
        124,
        "return self._fallback_load(model_config, device_config)",
        "the disk fallback (daemon mode raises instead)",
    ),
    UpstreamLine(
        "srt/plugins/hook_registry.py",
        292,
        "# Propagate the patch to all other modules that imported the original",
        "a hooked send_msg/recv_msg is every importer's: the hooks act only inside a fetch",
    ),
)


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
    # Converging (``engine.converge``): the engine routes with what the daemons hold, which
    # agrees with this rank's daemon's map on the local slots it serves; its digest is that map's.
    digest = session.digest if session.converge is not None else layout_digest(map_of(metadata))
    return protocol.FetchLayout(
        engine_id=session.engine_id if session.attached else None,
        version=session.version,
        digest=digest,
    )


def around_fetch_from_cache(
    original_fn: Callable[..., Any], loader: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook body for ``IpcModelLoader._fetch_from_cache`` (FETCH_TARGET).

    Marks the fetch (a context variable) with the ``expert_layout`` field to send, and records
    where the weights came from: ``None`` from the original means no daemon socket, so the
    loader falls back to disk.
    """
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
    """AROUND hook body for ``send_msg`` as ``ipc_loader`` binds it (SEND_TARGET): adds
    ``expert_layout`` to a ``fetch_state`` request sent inside the loader's fetch.

    The hook registry rebinds every other module's ``from ... import send_msg`` too, which is
    why it acts only inside the fetch and passes everything else through.
    """
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
    """AROUND hook body for ``recv_msg`` as ``ipc_loader`` binds it (RECV_TARGET): a
    ``layout_refused`` reply received inside the loader's fetch raises ``LayoutRefusedError``
    with the daemon's reason. It is a ``RuntimeError``, which the original re-raises untouched,
    so the engine fails with that reason and never falls back to disk."""
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
