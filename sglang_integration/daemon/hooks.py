"""The hooks on sglang's ``WeightCacheDaemon``: the expert layout protocol inside the daemon.

The one module that knows the daemon's internals (``weight_cache/daemon.py``): ``around_load``
opens the daemon's record once the weights are loaded, ``around_serve`` widens the listen backlog
and ends the record cleanly, ``around_handle_connection`` answers the layout requests and checks
``fetch_state`` before sglang's own handler sees it, and ``around_spawn_weight_cache_daemon``
makes every daemon sglang spawns hooked. The lines of sglang they rely on are ``UPSTREAM_LINES``.

No exception of the plugin's own logic escapes into the serve loop: a failure inside the service
becomes an ``error`` reply (``layout_refused`` for a fetch, the safe side). Replies are built by
``layout_ledger.wire.protocol`` (docs/protocol.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.wire import protocol
from layout_ledger.wire.healing import Healing
from layout_ledger.wire.service import LayoutService
from sglang_integration import settings
from sglang_integration.content.model_slots import ModelSlots, model_slots
from sglang_integration.daemon import ledger_paths
from sglang_integration.daemon.attach_watcher import WatcherStopped
from sglang_integration.daemon.checkpoint_reload import daemon_healing
from sglang_integration.daemon.connections import BoundedConnection
from sglang_integration.daemon.layout_choice import chosen_before_load
from sglang_integration.daemon.layout_side import (
    DaemonLayoutSide,
    close_daemon_layout,
    daemon_layout,
    set_daemon_layout,
)
from sglang_integration.daemon.placement import kept_model_config, register_placement_hook
from sglang_integration.daemon.record_opening import (
    config_fingerprint,
    daemon_retention,
    loaded_fingerprints,
    open_ledger_record,
    start_planned_record,
)
from sglang_integration.daemon.socket_stand_ins import (
    BacklogSocketModule,
    RecordingConnection,
    ReplayConnection,
)
from sglang_integration.settings import REQUEST_TIMEOUT, ContentCheck, content_check
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_DAEMON_MODULE = "sglang.srt.weight_cache.daemon"
LOAD_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon.load"
SERVE_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon.serve"
HANDLE_TARGET = f"{_DAEMON_MODULE}.WeightCacheDaemon._handle_connection"
SPAWN_TARGET = f"{_DAEMON_MODULE}.spawn_weight_cache_daemon"

# The daemon's listen backlog (sglang listens with 8: a burst of engine ranks connecting at
# once, each with a timeout and so a non-blocking connect, got EAGAIN). Linux caps it at
# net.core.somaxconn.
LISTEN_BACKLOG = 4096

_DAEMON_FILE = "srt/weight_cache/daemon.py"
# The lines of sglang's daemon these hooks rely on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(_DAEMON_FILE, 252, "def load(self", "the load hook runs after all of it"),
    UpstreamLine(
        _DAEMON_FILE,
        325,
        "self._init_distributed(server_args, model_config)",
        "the daemons' world group exists before the layout is made (layout_to_load gathers on it)",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        326,
        "self._initialize_eplb_expert_location_metadata(model_config)",
        "load sets the global ExpertLocationMetadata (with --enable-eplb), the initial map",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        375,
        "self.model = loader.load_model(",
        "daemon.model, whose slots we fingerprint",
    ),
    UpstreamLine(_DAEMON_FILE, 491, "def serve(self", "the serve hook runs around it"),
    UpstreamLine(
        _DAEMON_FILE,
        497,
        "sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)",
        "serve's listening socket comes from the module's name socket (_listen_backlog)",
    ),
    UpstreamLine(_DAEMON_FILE, 503, "sock.listen(8)", "the backlog _listen_backlog raises"),
    UpstreamLine(
        _DAEMON_FILE,
        535,
        "conn.settimeout(CLIENT_CONNECTION_TIMEOUT)",
        "serve's 30 s per operation, which the connection deadlines replace",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        537,
        "self._handle_connection(conn)",
        "serve hands each connection to the handler, then always closes it",
    ),
    UpstreamLine(
        _DAEMON_FILE, 546, "except socket.timeout:", "serve's only other use of the name socket"
    ),
    UpstreamLine(
        _DAEMON_FILE, 556, "def _handle_connection(self, conn", "the connection hook's target"
    ),
    UpstreamLine(_DAEMON_FILE, 558, "req = recv_msg(conn)", "the handler reads one frame first"),
    UpstreamLine(
        _DAEMON_FILE,
        566,
        'engine_config = CacheConfig.from_dict(req["config"])',
        "the handler's config test, which _config_matches repeats",
    ),
    UpstreamLine(
        _DAEMON_FILE, 567, "if not self.config.matches(engine_config):", "the same config test"
    ),
    UpstreamLine(
        _DAEMON_FILE,
        625,
        "def run_weight_cache_daemon(",
        "a spawned daemon's entry point, run once the hooks are installed",
    ),
    UpstreamLine(_DAEMON_FILE, 681, "def spawn_weight_cache_daemon(", "the spawn hook's target"),
    UpstreamLine(
        _DAEMON_FILE,
        690,
        'ctx = multiprocessing.get_context("spawn")',
        "its only act, a spawned process, which the spawn hook repeats with the hooked target",
    ),
    UpstreamLine(
        _DAEMON_FILE, 692, "target=run_weight_cache_daemon,", "the target the spawn hook replaces"
    ),
)


# --- installing the hooks ---------------------------------------------------------------------


def register_spawn_hook() -> None:
    """Make every daemon sglang spawns (engine ``daemon`` mode, standalone launcher) hooked."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SPAWN_TARGET, around_spawn_weight_cache_daemon, HookType.AROUND)


def register_daemon_hooks() -> None:
    """Register the daemon-class hooks (``placement``'s among them) and the spawn hook (applied
    by ``apply_hooks``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LOAD_TARGET, around_load, HookType.AROUND)
    HookRegistry.register(SERVE_TARGET, around_serve, HookType.AROUND)
    HookRegistry.register(HANDLE_TARGET, around_handle_connection, HookType.AROUND)
    register_placement_hook()
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


# --- WeightCacheDaemon.load -----------------------------------------------------------------------


def around_load(original_fn: Callable[..., Any], daemon: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WeightCacheDaemon.load``: load, then open the record of the initial layout.

    ``load`` builds sglang's global ``ExpertLocationMetadata`` (with ``--enable-eplb``) and
    keeps the model in ``daemon.model``. From them the record starts at version 0: the map,
    and the fingerprints of the daemon's local slots of ``routed_experts_weights_of_layer``
    (``record_opening``). Without ``--enable-eplb``, or for a model without routed experts, the
    service has no record and answers the layout requests ``no_record``.
    """
    request_timeout = REQUEST_TIMEOUT.read()  # a bad setting fails before the long load
    result = original_fn(daemon, *args, **kwargs)
    try:
        ledger, record, slots, healing = _open_record_after_load(daemon)
    except LedgerError as exc:
        # One line, no traceback: the daemon cannot keep a record it trusts, so it stops.
        logger.error("the expert layout ledger cannot be opened, the daemon stops: %s", exc)
        raise SystemExit(2) from None
    set_daemon_layout(daemon, LayoutService(record, slots, healing), ledger, request_timeout)
    return result


def _daemon_slots(daemon: Any, metadata: Any, mode: ContentCheck) -> ModelSlots | None:
    """The loaded model's local slots (this daemon's EP rank), unless the check is off.

    The rank's first slot is ``moe_ep_rank * num_local_physical_experts``.
    """
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
) -> tuple[Ledger | None, LayoutRecord | None, ModelSlots | None, Healing | None]:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import get_exec

    if not get_exec().moe.enable_eplb:
        logger.info("started without --enable-eplb: this daemon keeps no expert layout record")
        return None, None, None, None
    metadata = get_global_expert_location_metadata()
    if metadata is None:
        logger.info("the model has no routed experts: this daemon keeps no expert layout record")
        return None, None, None, None
    initial_map: Map = metadata.physical_to_logical_map.cpu().tolist()
    geometry = Geometry(
        num_layers=int(metadata.num_layers),
        num_physical_slots=int(metadata.num_physical_experts),
        num_logical_experts=int(metadata.num_logical_experts),
    )
    mode = content_check()
    slots = _daemon_slots(daemon, metadata, mode)
    healing = daemon_healing(
        daemon.model,
        kept_model_config(daemon),
        str(daemon.model_path),
        slots,
        initial_map,
        mode=settings.HEAL.read().value,
        timeout=settings.HEAL_TIMEOUT.read(),
    )
    device_uuid = current_platform.get_device_uuid(daemon.gpu_id)
    label = (
        f"pid={os.getpid()} gpu={daemon.gpu_id} tp_rank={daemon.tp_rank} "
        f"pp_rank={daemon.pp_rank} socket={daemon.socket_path}"
    )
    before = chosen_before_load(daemon)
    if before is None or before.opened.ledger is None:
        # No hook chose the layout before the load (sglang's initial one): version 0.
        ledger, record = open_ledger_record(
            ledger_paths.prepare_ledger_path(device_uuid),
            geometry,
            initial_map,
            retention=daemon_retention(),
            config_fingerprint=config_fingerprint(daemon.config.to_dict()),
            daemon_label=label,
            origin=daemon_origin(daemon, device_uuid),
            content=loaded_fingerprints(slots, mode),
            heal=healing.describe(),
            mode=mode,
        )
        return ledger, record, slots if record.content is not None else None, healing
    if initial_map != before.plan.physical_to_logical_map:
        before.opened.ledger.close()
        raise LedgerError(
            "sglang's expert location metadata after the load is not the map the restore "
            "chose before it; the layout hook did not install it"
        )
    record = start_planned_record(
        before.opened.ledger,
        geometry,
        before.plan,
        checkpoint_digest=before.checkpoint_digest,
        config_fingerprint=config_fingerprint(daemon.config.to_dict()),
        daemon_label=label,
        origin=daemon_origin(daemon, device_uuid),
        content=loaded_fingerprints(slots, mode),
        mode=mode,
        heal=healing.describe(),
    )
    return before.opened.ledger, record, slots if record.content is not None else None, healing


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
    """AROUND ``WeightCacheDaemon.serve``: a larger listen backlog; when the loop ends
    (SIGTERM/SIGINT), stop serving connections and end the incarnation cleanly."""
    try:
        with _listen_backlog(sys.modules[_DAEMON_MODULE], LISTEN_BACKLOG):
            return original_fn(daemon, *args, **kwargs)
    finally:
        close_daemon_layout(daemon)


@contextlib.contextmanager
def _listen_backlog(daemon_module: Any, backlog: int) -> Iterator[None]:
    """While serve runs, the daemon module's ``socket`` listens with at least ``backlog``.

    serve uses that name only for its listening socket and ``socket.timeout``
    (``UPSTREAM_LINES``), so swapping it for the call changes nothing else.
    """
    original = daemon_module.socket
    daemon_module.socket = BacklogSocketModule(backlog)
    try:
        yield
    finally:
        daemon_module.socket = original


# --- WeightCacheDaemon._handle_connection ---------------------------------------------------------


def around_handle_connection(original_fn: Callable[..., Any], daemon: Any, conn: Any) -> Any:
    """AROUND ``WeightCacheDaemon._handle_connection``: serve ``conn`` on its own thread.

    serve's loop goes back to ``accept`` at once; the daemon's ``ConnectionThreads`` serve the
    connection within the request and reply deadlines (``_serve_connection``).
    """
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
    """One connection, on its thread: one request read with sglang's ``recv_msg``, then

    - the ``expert_layout_*`` types go to the service; an ``ok`` attach hands a duplicate of the
      connection to the attach watcher before the reply is sent, so it outlives serve's
      ``conn.close()`` and its EOF detaches the engine;
    - a ``fetch_state`` whose config matches gets the layout check; a refusal is answered
      ``layout_refused`` before any transport work;
    - everything else (``ping``, ``query_config``, unknown types, non-dict requests, a
      ``fetch_state`` with a mismatched or broken config, or one the check lets through) goes
      to sglang's original handler on a connection that replays the frame's bytes, so its
      replies, log lines, errors and transport call are sglang's own.
    """
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    recording = RecordingConnection(conn)
    # sglang's framing, size cap and restricted unpickler; what it raises, the connection
    # thread logs as serve logs it (the original handler's first line is this same call).
    request = recv_msg(recording)
    kind = request.get("type") if isinstance(request, dict) else None
    if isinstance(kind, str) and kind in protocol.LAYOUT_REQUEST_TYPES:
        _answer_layout_request(layout, conn, request, kind)
        if kind in MOVE_REQUEST_TYPES:
            _serve_kept_connection(layout, conn, request.get("engine_id"))
        return
    if kind == protocol.FETCH_STATE and _config_matches(daemon, request):
        refusal = _check_fetch(layout.service, request)
        if refusal is not None:
            send_msg(conn, refusal)
            return
    original_fn(daemon, ReplayConnection(conn, bytes(recording.received)))


# The requests an engine rank sends on its one kept connection (docs/protocol.md "Framing").
MOVE_REQUEST_TYPES = frozenset({protocol.BEGIN, protocol.COMMIT, protocol.ABORT})
KEPT_CONNECTION_REFUSAL = (
    "a kept connection carries only begin, commit and abort of the engine whose request "
    "opened it; send other requests on a connection of their own"
)


def _serve_kept_connection(
    layout: DaemonLayoutSide, conn: BoundedConnection, engine_id: Any
) -> None:
    """After a begin, commit or abort: serve that engine's next ones on the same connection.

    An engine rank keeps one connection for its life. Each request on it has the deadlines of
    a new connection (``BoundedConnection.next_request``); idle between two, the connection
    stays open while ``engine_id`` is attached here, and at most one request timeout once it
    is not. A client of one request closes after its reply, which ends the loop silently. Any
    other request, or one naming another engine, is answered ``error`` and the connection ends.
    """
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    def attached() -> bool:
        record = layout.service.record
        return record is not None and isinstance(engine_id, str) and engine_id in record.attached

    while conn.next_request(attached):
        request = recv_msg(conn)
        kind = request.get("type") if isinstance(request, dict) else None
        if kind not in MOVE_REQUEST_TYPES or request.get("engine_id") != engine_id:
            send_msg(conn, protocol.refusal_reply(protocol.ERROR, KEPT_CONNECTION_REFUSAL))
            return
        _answer_layout_request(layout, conn, request, str(kind))


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

    A spawned daemon is a fresh interpreter that never ran the plugin (the engine side registers
    this hook for ``--weight-cache-mode daemon``, the standalone launcher too). ``original_fn``
    is not called: its only act is ``ctx.Process(target=run_weight_cache_daemon, ...)``, and the
    child would run that unhooked. The context, arguments and return value are the original's.
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
