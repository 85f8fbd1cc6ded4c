"""The hooks on sglang 0.5.23's ``WeightCacheDaemon``: the expert layout protocol in the daemon.

This module is the one place that knows the daemon's internals (``weight_cache/daemon.py``):

- ``WeightCacheDaemon.load`` ends by building the initial expert layout with
  ``_initialize_eplb_expert_location_metadata`` when ``--enable-eplb``
  (``get_exec().moe.enable_eplb``) and keeps the loaded model in ``daemon.model``. ``around_load``
  runs the original, then reads that global ``ExpertLocationMetadata.physical_to_logical_map``,
  fingerprints the daemon's local slots of ``daemon.model.routed_experts_weights_of_layer`` (the
  rank's first slot is ``moe_ep_rank * num_local_physical_experts``; not with the content check
  off, ``content_settings``), opens the daemon's ledger (``ledger_paths``), starts a new
  incarnation at version 0 with those fingerprints, checks that replicas hold the same bytes
  (``LayoutRecord.check_loaded_content``) and keeps a ``LayoutService`` on the daemon, whose
  content source fingerprints the same tensors again at each commit, content check and repair.
  Without ``--enable-eplb`` (or for a model without routed experts) the service has no record and
  answers the layout requests with ``no_record``.
- ``WeightCacheDaemon.serve`` binds its socket, ``listen(8)``\\ s, accepts connections one at a
  time, gives each a 30 s timeout, calls ``_handle_connection(conn)`` and always
  ``conn.close()``\\ s it after, logging (never raising) any exception. ``around_serve`` runs it
  with a listen backlog of at least ``LISTEN_BACKLOG`` (``_listen_backlog``: for the call, the
  daemon module's name ``socket`` is the socket module with a ``socket`` class whose ``listen``
  raises the backlog; serve uses that name only for this socket and ``socket.timeout``), then
  stops the connection threads and the attach watcher and ends the ledger incarnation cleanly
  when the loop stops (SIGTERM/SIGINT).
- ``WeightCacheDaemon._handle_connection`` reads one request with ``recv_msg`` and branches on
  ``req.get("type")``. ``around_handle_connection`` hands the connection to the daemon's
  ``ConnectionThreads`` and returns, so serve's loop goes back to ``accept`` at once; on its own
  thread, within the request and reply deadlines (``bounded_connections``), the connection is
  served as follows. The request is read through sglang's own ``recv_msg`` while keeping the
  frame's bytes, then:

  * the seven ``expert_layout_*`` types go to the service; an ``ok`` attach hands a duplicate of
    the connection to the ``AttachWatcher`` before the reply is sent, so the connection outlives
    serve's ``conn.close()`` and its EOF detaches the engine;
  * ``fetch_state`` whose config matches (the same ``CacheConfig.from_dict`` / ``matches`` test
    as the original handler) gets the layout check; a refusal is answered ``layout_refused``
    before any transport work;
  * everything else (``ping``, ``query_config``, unknown types, non-dict requests, a
    ``fetch_state`` with a mismatched or broken config, and a ``fetch_state`` the layout check
    lets through) runs sglang's original handler on a connection that replays the frame's
    bytes, so its replies, log lines, errors and transport call are sglang's own, unchanged.

- ``spawn_weight_cache_daemon`` starts each daemon with ``multiprocessing`` spawn: a fresh
  interpreter that never ran the plugin. ``around_spawn_weight_cache_daemon`` (the engine side
  registers it for ``--weight-cache-mode daemon``; the standalone launcher too) starts the same
  process with ``run_hooked_weight_cache_daemon`` as its target, which installs these hooks and
  then runs sglang's ``run_weight_cache_daemon`` unchanged.

The plugin never lets an exception escape into the serve loop from its own logic: a failure
inside the service becomes an ``error`` reply (or ``layout_refused`` for a fetch, the safe side).
Replies are built by ``layout_ledger.wire.protocol`` (docs/protocol.md).

Where in sglang 0.5.23's ``weight_cache/daemon.py`` (line numbers, to recheck on an upgrade):
``load`` 252-401, its ``_initialize_eplb_expert_location_metadata`` call 326 (defined 474-489);
``serve`` 491-554, its ``socket.socket`` 497, ``listen(8)`` 503, ``socket.timeout`` 546, the
per-connection timeout 535 (``CLIENT_CONNECTION_TIMEOUT`` 87); ``_handle_connection`` 556-611, its
config test 566-567;
``run_weight_cache_daemon`` 625-658; ``spawn_weight_cache_daemon`` 681-696, its spawn 690-696.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import socket
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.retention import Retention
from layout_ledger.wire import protocol
from layout_ledger.wire.service import LayoutService
from sglang_integration.content.model_slots import ModelSlots, model_slots
from sglang_integration.daemon import ledger_paths
from sglang_integration.daemon.attach_watcher import AttachWatcher, WatcherStopped
from sglang_integration.daemon.connections import BoundedConnection, ConnectionThreads
from sglang_integration.settings import ContentCheck, content_check

logger = logging.getLogger(__name__)

_DAEMON_MODULE = "sglang.srt.weight_cache.daemon"
LOAD_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon.load"
SERVE_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon.serve"
HANDLE_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon._handle_connection"
SPAWN_TARGET = f"{_DAEMON_MODULE}.spawn_weight_cache_daemon"

# The attribute of a WeightCacheDaemon that holds its DaemonLayoutSide.
_LAYOUT_ATTR = "_expert_layout"

# The daemon's listen backlog (sglang listens with 8: a burst of engine ranks connecting at
# once, each with a timeout and so a non-blocking connect, got EAGAIN). Linux caps it at
# net.core.somaxconn.
LISTEN_BACKLOG = 4096


@dataclass
class DaemonLayoutSide:
    """The expert layout side of one daemon: its service, connections, watcher and ledger."""

    service: LayoutService
    watcher: AttachWatcher
    connections: ConnectionThreads
    ledger: Ledger | None = None

    def close(self) -> None:
        """Stop serving connections and watching attach connections, then end the incarnation."""
        self.connections.stop()
        self.watcher.stop()
        if self.ledger is not None:
            self.ledger.close()


# --- installing the hooks ---------------------------------------------------------------------


def register_spawn_hook() -> None:
    """Make every daemon sglang spawns (engine ``daemon`` mode, standalone launcher) hooked."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SPAWN_TARGET, around_spawn_weight_cache_daemon, HookType.AROUND)


def register_daemon_hooks() -> None:
    """Register the daemon-class hooks and the spawn hook (applied by ``apply_hooks``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LOAD_TARGET, around_load, HookType.AROUND)
    HookRegistry.register(SERVE_TARGET, around_serve, HookType.AROUND)
    HookRegistry.register(HANDLE_TARGET, around_handle_connection, HookType.AROUND)
    register_spawn_hook()


class _Installed:
    done = False


def install_daemon_hooks() -> None:
    """Register and apply the daemon hooks in this (daemon) process; idempotent."""
    if _Installed.done:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    register_daemon_hooks()
    HookRegistry.apply_hooks()
    _Installed.done = True
    logger.info("expert layout hooks installed on sglang's WeightCacheDaemon")


# --- the layout side of a daemon ----------------------------------------------------------------


def open_ledger_record(
    path: str | os.PathLike[str],
    geometry: Geometry,
    initial_map: Map,
    *,
    retention: Retention,
    config_fingerprint: str,
    daemon_label: str,
    origin: IncarnationOrigin | None = None,
    content: LocalFingerprints | None = None,
) -> tuple[Ledger, LayoutRecord]:
    """Open the ledger (one writer) and start a new incarnation at version 0, recording where
    it runs (``origin``) and the slots' fingerprints (when the daemon records them)."""
    ledger = Ledger.open(path, retention)
    try:
        record = ledger.start_incarnation(
            geometry,
            initial_map,
            config_fingerprint=config_fingerprint,
            daemon_label=daemon_label,
            origin=origin,
            content=content,
        )
    except BaseException:
        ledger.close()
        raise
    return ledger, record


def loaded_fingerprints(slots: ModelSlots | None, mode: ContentCheck) -> LocalFingerprints | None:
    """The local slots' fingerprints at load (None: content check off, or no tensors)."""
    if slots is None or mode is ContentCheck.OFF:
        return None
    local = slots.fingerprints()
    logger.info(
        "fingerprinted %d local slots (from slot %d) of %d layers at load",
        slots.num_slots,
        slots.first_slot,
        len(local.layers),
    )
    return local


def check_loaded_content(record: LayoutRecord, mode: ContentCheck) -> None:
    """Replicas must hold the same bytes; ``enforce`` marks the daemon dirty when they do not."""
    problem = record.check_loaded_content(enforce=mode is ContentCheck.ENFORCE)
    if problem is None:
        return
    if mode is ContentCheck.ENFORCE:
        logger.error(
            "expert layout is dirty from the start, fetch_state and begin are refused: %s", problem
        )
    else:
        logger.warning("%s (content check warn: serving anyway)", problem)


def set_daemon_layout(
    daemon: Any,
    service: LayoutService,
    ledger: Ledger | None = None,
    request_timeout: float | None = None,
) -> None:
    """Give ``daemon`` its layout side and start its attach watcher.

    ``request_timeout``: the connection deadline in seconds (None: ``ledger_paths``' setting).
    """
    if request_timeout is None:
        request_timeout = ledger_paths.request_timeout_from_env()
    previous = getattr(daemon, _LAYOUT_ATTR, None)
    if previous is not None:
        raise RuntimeError("this daemon already has an expert layout service")

    def detach(engine_id: str, reason: str) -> None:
        try:
            service.detach(engine_id, reason)
        except LedgerError as exc:
            logger.error(
                "could not record engine %r's detach (%s): %s; the daemon counts it as "
                "attached until it restarts, so no other engine may move experts",
                engine_id,
                reason,
                exc,
            )

    watcher = AttachWatcher(detach)
    watcher.start()
    connections = ConnectionThreads(request_timeout)
    setattr(daemon, _LAYOUT_ATTR, DaemonLayoutSide(service, watcher, connections, ledger))


def daemon_layout(daemon: Any) -> DaemonLayoutSide | None:
    return getattr(daemon, _LAYOUT_ATTR, None)


def close_daemon_layout(daemon: Any) -> None:
    """End the daemon's layout side (clean incarnation end); safe to call twice."""
    layout = getattr(daemon, _LAYOUT_ATTR, None)
    if layout is None:
        return
    setattr(daemon, _LAYOUT_ATTR, None)
    try:
        layout.close()
    except LedgerError as exc:
        logger.error("could not end the expert layout ledger's incarnation cleanly: %s", exc)


def config_fingerprint(config_dict: dict[str, Any]) -> str:
    """SHA-256 of the daemon's CacheConfig, recorded with each incarnation."""
    text = json.dumps(config_dict, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# --- WeightCacheDaemon.load -----------------------------------------------------------------------


def around_load(original_fn: Callable[..., Any], daemon: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WeightCacheDaemon.load``: load, then open the record of the initial layout."""
    request_timeout = ledger_paths.request_timeout_from_env()  # a bad setting fails first
    result = original_fn(daemon, *args, **kwargs)
    try:
        ledger, record, slots = _open_record_after_load(daemon)
    except LedgerError as exc:
        # One line, no traceback: the daemon cannot keep a record it trusts, so it stops.
        logger.error("the expert layout ledger cannot be opened, the daemon stops: %s", exc)
        raise SystemExit(2) from None
    set_daemon_layout(daemon, LayoutService(record, slots), ledger, request_timeout)
    return result


def _daemon_slots(daemon: Any, metadata: Any, mode: ContentCheck) -> ModelSlots | None:
    """The loaded model's local slots (this daemon's EP rank), unless the check is off."""
    if mode is ContentCheck.OFF:
        return None
    if getattr(daemon.model, "routed_experts_weights_of_layer", None) is None:
        logger.warning("the loaded model has no routed_experts_weights_of_layer: no fingerprints")
        return None
    from sglang.srt.runtime_context import get_parallel

    local = int(metadata.num_local_physical_experts)
    return model_slots(daemon.model, get_parallel().moe_ep_rank * local, local)


def _open_record_after_load(
    daemon: Any,
) -> tuple[Ledger | None, LayoutRecord | None, ModelSlots | None]:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import get_exec

    if not get_exec().moe.enable_eplb:
        logger.info("started without --enable-eplb: this daemon keeps no expert layout record")
        return None, None, None
    metadata = get_global_expert_location_metadata()
    if metadata is None:
        logger.info("the model has no routed experts: this daemon keeps no expert layout record")
        return None, None, None
    initial_map: Map = metadata.physical_to_logical_map.cpu().tolist()
    geometry = Geometry(
        num_layers=int(metadata.num_layers),
        num_physical_slots=int(metadata.num_physical_experts),
        num_logical_experts=int(metadata.num_logical_experts),
    )
    mode = content_check()
    slots = _daemon_slots(daemon, metadata, mode)
    device_uuid = current_platform.get_device_uuid(daemon.gpu_id)
    path = ledger_paths.prepare_ledger_path(device_uuid)
    ledger, record = open_ledger_record(
        path,
        geometry,
        initial_map,
        retention=ledger_paths.retention_from_env(),
        config_fingerprint=config_fingerprint(daemon.config.to_dict()),
        daemon_label=(
            f"pid={os.getpid()} gpu={daemon.gpu_id} tp_rank={daemon.tp_rank} "
            f"pp_rank={daemon.pp_rank} socket={daemon.socket_path}"
        ),
        origin=daemon_origin(daemon, device_uuid),
        content=loaded_fingerprints(slots, mode),
    )
    check_loaded_content(record, mode)
    return ledger, record, slots if record.content is not None else None


def daemon_origin(daemon: Any, device_uuid: str | None) -> IncarnationOrigin:
    """Where this daemon runs: host, pid and versions, and what ``WeightCacheDaemon.__init__``
    and ``load`` set (``gpu_id``, ``tp_rank``, ``pp_rank``, ``socket_path``; the EP rank is its
    ``CacheConfig.moe_ep_rank``)."""
    config = getattr(daemon, "config", None)
    ep_rank = getattr(config, "moe_ep_rank", None)
    return IncarnationOrigin.of_this_process(
        device_uuid=device_uuid,
        gpu_id=_int_or_none(getattr(daemon, "gpu_id", None)),
        tp_rank=_int_or_none(getattr(daemon, "tp_rank", None)),
        pp_rank=_int_or_none(getattr(daemon, "pp_rank", None)),
        ep_rank=_int_or_none(ep_rank),
        socket_path=getattr(daemon, "socket_path", None),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- WeightCacheDaemon.serve ----------------------------------------------------------------------


def around_serve(original_fn: Callable[..., Any], daemon: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WeightCacheDaemon.serve``: a larger listen backlog; when the loop ends, stop
    serving connections and end the incarnation cleanly."""
    try:
        with _listen_backlog(sys.modules[_DAEMON_MODULE], LISTEN_BACKLOG):
            return original_fn(daemon, *args, **kwargs)
    finally:
        close_daemon_layout(daemon)


class _BacklogSocketModule(types.ModuleType):
    """The socket module, except that its ``socket`` class listens with a larger backlog."""

    def __init__(self, backlog: int) -> None:
        super().__init__(socket.__name__)

        class ListeningSocket(socket.socket):
            def listen(self, requested: int = backlog, /) -> None:
                super().listen(max(requested, backlog))

        self.socket = ListeningSocket

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)


@contextlib.contextmanager
def _listen_backlog(daemon_module: types.ModuleType, backlog: int) -> Iterator[None]:
    """While serve runs, the daemon module's ``socket`` listens with at least ``backlog``."""
    original = daemon_module.socket
    daemon_module.socket = _BacklogSocketModule(backlog)
    try:
        yield
    finally:
        daemon_module.socket = original


# --- WeightCacheDaemon._handle_connection ---------------------------------------------------------


class _RecordingConnection:
    """Reads through to the connection and keeps every byte read (one request frame)."""

    def __init__(self, conn: BoundedConnection) -> None:
        self._conn = conn
        self.received = bytearray()

    def recv(self, size: int) -> bytes:
        data = self._conn.recv(size)
        self.received.extend(data)
        return data


class _ReplayConnection:
    """The connection, with the already-read frame served again to the first reads."""

    def __init__(self, conn: BoundedConnection, already_read: bytes) -> None:
        self._conn = conn
        self._replay = memoryview(bytes(already_read))

    def recv(self, size: int, *args: Any) -> bytes:
        if self._replay:
            chunk, self._replay = self._replay[:size], self._replay[size:]
            return bytes(chunk)
        return self._conn.recv(size, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def around_handle_connection(original_fn: Callable[..., Any], daemon: Any, conn: Any) -> Any:
    """AROUND ``WeightCacheDaemon._handle_connection``: serve ``conn`` on its own thread."""
    layout = daemon_layout(daemon)
    if layout is None:
        return original_fn(daemon, conn)  # no layout side (load() did not run through the hook)
    layout.connections.submit(
        conn, functools.partial(_serve_connection, original_fn, daemon, layout)
    )
    return None


def _serve_connection(
    original_fn: Callable[..., Any], daemon: Any, layout: DaemonLayoutSide, conn: BoundedConnection
) -> None:
    """One connection, on its thread: see the module docstring."""
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    recording = _RecordingConnection(conn)
    # sglang's framing, size cap and restricted unpickler; what it raises, the connection
    # thread logs as serve logs it (the original handler's first line is this same call).
    request = recv_msg(recording)
    kind = request.get("type") if isinstance(request, dict) else None
    if isinstance(kind, str) and kind in protocol.LAYOUT_REQUEST_TYPES:
        _answer_layout_request(layout, conn, request, kind)
        return
    if kind == protocol.FETCH_STATE and _config_matches(daemon, request):
        refusal = _check_fetch(layout.service, request)
        if refusal is not None:
            send_msg(conn, refusal)
            return
    original_fn(daemon, _ReplayConnection(conn, bytes(recording.received)))


def _config_matches(daemon: Any, request: dict[str, Any]) -> bool:
    """sglang's own fetch_state config test; False where it would fail."""
    from sglang.srt.weight_cache.protocol import CacheConfig

    try:
        return bool(daemon.config.matches(CacheConfig.from_dict(request["config"])))
    except Exception:
        # A missing or broken config: the original handler raises or replies for it, exactly
        # as sglang does, when this request is handed to it.
        return False


def _check_fetch(service: LayoutService, request: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return service.check_fetch(request)
    except Exception as exc:
        logger.exception("the expert layout check of a fetch_state failed")
        return protocol.refusal_reply(
            protocol.LAYOUT_REFUSED,
            f"the daemon could not check the expert layout of this fetch "
            f"({type(exc).__name__}: {exc}); it does not serve unchecked weights, see its log",
        )


def _answer_layout_request(
    layout: DaemonLayoutSide, conn: BoundedConnection, request: dict[str, Any], kind: str
) -> None:
    from sglang.srt.weight_cache.protocol import send_msg

    try:
        reply = layout.service.handle(request)
    except Exception as exc:
        logger.exception("handling a %s request failed", kind)
        reply = protocol.refusal_reply(
            protocol.ERROR,
            f"the daemon failed to handle {kind} ({type(exc).__name__}: {exc}); see its log",
        )
    if kind == protocol.ATTACH and reply.get("status") == protocol.OK:
        reply = _keep_attach_connection(layout, conn, request["engine_id"], reply)
    send_msg(conn, reply)


def _keep_attach_connection(
    layout: DaemonLayoutSide, conn: BoundedConnection, engine_id: str, reply: dict[str, Any]
) -> dict[str, Any]:
    """Hand a duplicate of ``conn`` to the watcher; the connection thread closes only its own.

    Done before the reply is sent: if the engine is gone by then, the watcher sees the EOF.
    """
    try:
        kept = conn.dup()
    except OSError as exc:
        failure = f"the daemon could not keep the attach connection open: {exc}"
    else:
        try:
            layout.watcher.watch(kept, engine_id)
            return reply
        except WatcherStopped as exc:
            failure = str(exc)
    try:
        layout.service.detach(engine_id, failure)
    except LedgerError as exc:
        logger.error("could not record engine %r's detach: %s", engine_id, exc)
    return protocol.refusal_reply(protocol.ERROR, f"{failure}; retry the attach")


# --- spawned daemons (engine --weight-cache-mode daemon, standalone launcher) ---------------------


def around_spawn_weight_cache_daemon(
    original_fn: Callable[..., Any],
    server_args: Any,
    *,
    gpu_id: int,
    tp_rank: int,
    pp_rank: int,
    dist_init_method: str,
) -> Any:
    """AROUND ``spawn_weight_cache_daemon``: sglang's spawn, with the hooked target.

    ``original_fn`` is not called: its only act is ``ctx.Process(target=run_weight_cache_daemon,
    ...)``, and a spawned child would run that unhooked. The context, arguments and return value
    are the original's.
    """
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_hooked_weight_cache_daemon,
        args=(server_args, gpu_id, tp_rank, pp_rank, dist_init_method),
    )
    proc.start()
    return proc


def run_hooked_weight_cache_daemon(
    server_args: Any,
    gpu_id: int,
    tp_rank: int,
    pp_rank: int,
    dist_init_method: str | None = None,
) -> None:
    """A spawned daemon's entry point: install the hooks, then sglang's own entry point."""
    install_daemon_hooks()
    from sglang.srt.weight_cache import daemon as daemon_module

    daemon_module.run_weight_cache_daemon(
        server_args, gpu_id, tp_rank, pp_rank, dist_init_method=dist_init_method
    )
