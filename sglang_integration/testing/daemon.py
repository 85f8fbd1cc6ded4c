"""A model-less weight cache daemon for tests and demos on a CPU.

    python -m sglang_integration.testing.daemon --socket PATH --ledger PATH \\
        --num-layers L --num-logical-experts E --num-physical-experts P [--no-record] \\
        [--experts DIR --expert-rank R] [--expert-layout-content-check enforce|warn|off] \\
        [--expert-layout-restore last|initial]

runs sglang's real ``WeightCacheDaemon.serve`` loop and ``_handle_connection`` with this
plugin's hooks, serving no tensors. Its initial layout is sglang's trivial one (slot i holds
expert i mod E); ``query_config`` returns its ``CacheConfig``, and ``fetch_state`` with that
config succeeds (``ok``, no entries) when the layout check lets it through. It is ready when the
socket file exists, and exits 0 on SIGTERM or SIGINT (sglang's own handlers stop the loop; the
serve hook then ends the ledger incarnation cleanly). What of sglang's daemon it skips, and why:
``build_model_less_daemon``; its options beyond the contract: ``parse_args``; expert content:
``open_layout_service``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.retention import Retention
from layout_ledger.wire.service import ContentSource, LayoutService
from sglang_integration import settings
from sglang_integration.settings import CONTENT_CHECK, REQUEST_TIMEOUT, ContentCheck
from sglang_integration.testing.expert_files import ExpertFilesError
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

MODEL_ARCH = "ModelLessTestDaemon"

_DAEMON_FILE = "srt/weight_cache/daemon.py"
# What of sglang's daemon build_model_less_daemon stands in for (tests/test_upstream_lines.py
# checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(_DAEMON_FILE, 150, "def __init__(", "not called: its fields are set instead"),
    UpstreamLine(_DAEMON_FILE, 158, "self.server_args = server_args", "the first field it sets"),
    UpstreamLine(_DAEMON_FILE, 190, "self.transport_backend = None", "the last field it sets"),
    UpstreamLine(_DAEMON_FILE, 252, "def load(self", "not called: what it leaves is set instead"),
    UpstreamLine(_DAEMON_FILE, 329, "self.config = CacheConfig(", "load's config"),
    UpstreamLine(_DAEMON_FILE, 396, "self._export_state()", "load's tensors (none here)"),
    UpstreamLine(
        _DAEMON_FILE,
        644,
        "kill_itself_when_parent_died()",
        "run_weight_cache_daemon dies with its parent; main does the same",
    ),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The contract's options, and some beyond it.

    ``--in-memory`` keeps the record in memory (``MemoryJournal``, for benchmarks),
    ``--without-plugin`` runs sglang's daemon with no hook at all (for comparisons with
    sglang's own behaviour), ``--keep-versions`` / ``--prune-every`` set retention,
    ``--request-timeout`` the connection deadline (the launcher's
    ``--expert-layout-request-timeout``; without it ``settings.REQUEST_TIMEOUT``, as in a real
    daemon). ``--device-uuid``, ``--gpu-id``, ``--tp-rank``, ``--pp-rank`` and ``--ep-rank``
    say which rank this daemon stands in for: the ledger records them as the incarnation's
    origin (with the host, pid, socket and versions, which it always records); without them
    they are recorded as unknown, since a model-less daemon has no GPU.
    """
    parser = argparse.ArgumentParser(
        prog="python -m sglang_integration.testing.daemon",
        description="sglang's real WeightCacheDaemon serve loop with the expert layout hooks, "
        "without a model (for tests and demos on a CPU).",
    )
    parser.add_argument("--socket", required=True, help="Unix socket path to serve on")
    parser.add_argument("--ledger", help="ledger file (required unless --no-record/--in-memory)")
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--num-logical-experts", type=int, required=True)
    parser.add_argument("--num-physical-experts", type=int, required=True)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--no-record",
        action="store_true",
        help="keep no layout record, like a daemon started without --enable-eplb",
    )
    mode.add_argument(
        "--in-memory",
        action="store_true",
        help="keep the record in memory only (benchmark comparison; no ledger)",
    )
    mode.add_argument(
        "--without-plugin",
        action="store_true",
        help="run sglang's daemon with no expert layout hook (sglang 0.5.23's own behaviour)",
    )
    parser.add_argument(
        "--experts",
        metavar="DIR",
        help="serve EP rank --expert-rank's expert files in DIR (the format of "
        "sglang_integration.testing.expert_files) and fingerprint them",
    )
    parser.add_argument("--expert-rank", type=int, default=0, metavar="R")
    parser.add_argument(
        "--fingerprint-gate",
        metavar="DIR",
        help="a test's hook point: each fingerprinting of every slot after the load (a content "
        "check's, a repair's) writes DIR/read-N once the slots are read, then waits for DIR/go-N "
        "before the daemon compares them (testing.expert_files.GatedSlots)",
    )
    parser.add_argument(
        "--expert-layout-content-check",
        choices=settings.CHOICES,
        default=None,
        help=f"enforce, warn or off (default: {CONTENT_CHECK.env}, else "
        f"{CONTENT_CHECK.default_text})",
    )
    parser.add_argument(
        "--expert-layout-restore",
        choices=settings.RESTORE_CHOICES,
        default=None,
        help=f"last or initial (default: {settings.RESTORE.env}, else "
        f"{settings.RESTORE.default_text}); the model-less daemon reloads no weights, so its "
        f"expert files must hold the layout it restores",
    )
    parser.add_argument("--keep-versions", type=int, default=settings.DEFAULT_KEEP_VERSIONS)
    parser.add_argument("--prune-every", type=int, default=settings.DEFAULT_PRUNE_EVERY)
    parser.add_argument(
        "--request-timeout",
        default=None,
        metavar="SECONDS",
        help="seconds a client has for its whole request, and again for its reply "
        f"(default: {REQUEST_TIMEOUT.env}, else {REQUEST_TIMEOUT.default_text})",
    )
    parser.add_argument("--log-level", default="INFO")
    origin = parser.add_argument_group(
        "origin", "which rank this daemon stands in for (recorded in the ledger; default unknown)"
    )
    origin.add_argument("--device-uuid", help="the device UUID to record")
    for rank in ("gpu-id", "tp-rank", "pp-rank", "ep-rank"):
        origin.add_argument(f"--{rank}", type=int, help=f"the {rank.replace('-', ' ')} to record")
    args = parser.parse_args(argv)
    needs_ledger = not (args.no_record or args.in_memory or args.without_plugin)
    if needs_ledger and not args.ledger:
        parser.error("--ledger is required (or pass --no-record / --in-memory)")
    try:
        settings.RESTORE.export(args.expert_layout_restore, "--expert-layout-restore")
        if args.request_timeout is None:
            args.request_timeout = REQUEST_TIMEOUT.read()
        else:
            args.request_timeout = REQUEST_TIMEOUT.parse(args.request_timeout, "--request-timeout")
    except settings.SettingError as exc:
        parser.error(str(exc))
    return args


def model_less_cache_config(geometry: Geometry) -> dict[str, Any]:
    """The ``CacheConfig`` fields this daemon states (and that an engine must send back)."""
    from sglang.srt.weight_cache.protocol import compute_env_stamp

    return {
        "model_path": (
            f"model-less:{geometry.num_layers}x{geometry.num_physical_slots}"
            f"/{geometry.num_logical_experts}"
        ),
        "model_arch": MODEL_ARCH,
        "tp_size": 1,
        "tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "dp_size": 1,
        "ep_size": 1,
        "moe_dp_size": 1,
        "moe_dp_rank": 0,
        "moe_ep_rank": 0,
        "attn_dp_size": 1,
        "enable_dp_lm_head": False,
        "attn_cp_size": 1,
        "moe_dense_tp_size": None,
        "moe_a2a_backend": "none",
        "quant_method": "",
        "quant_config_hash": "",
        "dtype": "torch.bfloat16",
        "revision": "",
        **compute_env_stamp(),
    }


def build_model_less_daemon(socket_path: str, cache_config: dict[str, Any]) -> Any:
    """sglang's ``WeightCacheDaemon`` without ``__init__`` or ``load`` (``UPSTREAM_LINES``).

    - ``__init__`` is not called. It copies fields out of a resolved ``ServerArgs`` (which
      needs a model directory) and derives the socket path from
      ``current_platform.get_device_uuid(gpu_id)``, which sglang's generic platform on a CPU
      does not implement (``NotImplementedError``). The instance is made with ``__new__`` and
      every attribute ``__init__`` sets is set explicitly below, with the socket path given and
      the ready file beside it (``PATH.ready``).
    - ``load`` is not called: it requires a CUDA-alike platform (its first statement raises
      otherwise), then loads a model and exports CUDA IPC handles. What it leaves behind for
      serving is set instead: ``config`` (a ``CacheConfig`` naming this fake model, with
      sglang's own ``compute_env_stamp``), ``state_entries`` (empty: no tensors),
      ``transport_backend`` (sglang's ``choose_daemon_transport_backend({})``, i.e. torch_ipc)
      and ``preloaded_weights_bytes`` (0). The layout side that the load hook opens after
      ``load`` is opened by the same functions (``record_opening``, ``layout_side``) with the
      trivial map, so the only code not run is the load hook's reading of sglang's global
      ``ExpertLocationMetadata``.
    """
    from sglang.srt.weight_cache.daemon import WeightCacheDaemon
    from sglang.srt.weight_cache.protocol import CacheConfig
    from sglang.srt.weight_cache.transport import choose_daemon_transport_backend

    config = CacheConfig.from_dict(cache_config)
    daemon = WeightCacheDaemon.__new__(WeightCacheDaemon)
    # What __init__ sets, from the stated config instead of ServerArgs.
    daemon.server_args = None
    daemon.model_path = config.model_path
    daemon.gpu_id = 0
    daemon.tp_size = config.tp_size
    daemon.tp_rank = config.tp_rank
    daemon.pp_size = config.pp_size
    daemon.pp_rank = config.pp_rank
    daemon.ep_size = config.ep_size
    daemon.moe_dp_size = config.moe_dp_size
    daemon.enable_dp_lm_head = config.enable_dp_lm_head
    daemon.attn_cp_size = config.attn_cp_size
    daemon.moe_dense_tp_size = config.moe_dense_tp_size
    daemon.moe_a2a_backend = config.moe_a2a_backend
    daemon.deepep_mode = None
    daemon.load_format = None
    daemon.dtype = config.dtype
    daemon.quantization = None
    daemon.model_loader_extra_config = None
    daemon.trust_remote_code = False
    daemon.revision = config.revision
    daemon.dist_init_method = None
    daemon.socket_path = socket_path
    daemon.ready_path = f"{socket_path}.ready"
    daemon.model = None
    # What load() leaves for serving: no tensors.
    daemon.config = config
    daemon.state_entries = {}
    daemon.preloaded_weights_bytes = 0
    daemon.transport_backend = choose_daemon_transport_backend({})
    return daemon


def open_layout_service(
    args: argparse.Namespace, geometry: Geometry, cache_config: dict[str, Any]
) -> tuple[LayoutService, Ledger | None]:
    """The daemon's record as ``--no-record`` / ``--in-memory`` / ``--ledger`` ask.

    Without ``--experts`` the daemon has no tensors and records no fingerprints (it answers the
    content check ``no_record``). With ``--experts DIR --expert-rank R`` it maps EP rank R's
    expert files (``expert_files``: the format the CPU harness writes, the stand-in for a real
    daemon's CUDA-IPC tensors) and does what a real daemon with a model does: fingerprints its
    local slots at start (version 0) and checks replicas, fingerprints the moved layers at each
    commit, and answers the content check and repairs from them, as
    ``--expert-layout-content-check`` (else ``settings.CONTENT_CHECK``) says; it reloads slots
    from the synthetic checkpoint when asked (``synthetic_reload``: heal ``off``).
    """
    from sglang_integration.daemon.checkpoint_identity import checkpoint_digest
    from sglang_integration.daemon.record_opening import (
        check_loaded_content,
        config_fingerprint,
        loaded_fingerprints,
        start_planned_record,
    )
    from sglang_integration.daemon.restore import open_before_load, restore_before_load
    from sglang_integration.testing.expert_files import GatedSlots, expert_file_slots

    if args.no_record:
        return LayoutService(None), None
    initial_map = trivial_map(
        geometry.num_layers, geometry.num_physical_slots, geometry.num_logical_experts
    )
    mode = content_mode(args)
    slots = None
    if args.experts and mode is not ContentCheck.OFF:
        slots = expert_file_slots(args.experts, args.expert_rank, geometry)
    content = loaded_fingerprints(slots, mode)
    source: ContentSource | None = slots
    if slots is not None and args.fingerprint_gate:
        source = GatedSlots(slots, args.fingerprint_gate)
    healing = None
    if args.experts:
        from sglang_integration.testing.synthetic_reload import synthetic_healing

        healing = synthetic_healing(args.experts, args.expert_rank, slots)
    if args.in_memory:
        record = LayoutRecord.in_memory(geometry, initial_map, content=content)
        check_loaded_content(record, mode)
        return LayoutService(record, source, healing), None
    opened = open_before_load(
        args.ledger, Retention(keep_versions=args.keep_versions, prune_every=args.prune_every)
    )
    if opened.ledger is None:
        raise LedgerError(opened.problem)
    # A daemon alone (no process group); its weights (none, or the expert files) are what it
    # "loaded into" the plan's layout: a harness that restores writes the files in that map.
    # Its checkpoint is the same whatever its geometry (a model with more redundant experts).
    checkpoint = checkpoint_digest(MODEL_ARCH)
    restore = restore_before_load(
        opened, None, geometry=geometry, checkpoint_digest=checkpoint, initial_map=initial_map
    )
    record = start_planned_record(
        opened.ledger,
        geometry,
        restore,
        checkpoint_digest=checkpoint,
        config_fingerprint=config_fingerprint(cache_config),
        daemon_label=f"model-less pid={os.getpid()} socket={args.socket}",
        origin=IncarnationOrigin.of_this_process(
            device_uuid=args.device_uuid,
            gpu_id=args.gpu_id,
            tp_rank=args.tp_rank,
            pp_rank=args.pp_rank,
            ep_rank=args.ep_rank,
            socket_path=args.socket,
        ),
        content=content,
        mode=mode,
    )
    return LayoutService(record, source, healing), opened.ledger


def content_mode(args: argparse.Namespace) -> ContentCheck:
    if args.expert_layout_content_check is not None:
        return settings.content_check_mode(
            args.expert_layout_content_check, "--expert-layout-content-check"
        )
    return settings.content_check()


def remove_stale_socket(socket_path: str) -> None:
    """Remove a socket file a killed daemon left behind; refuse one a live daemon serves."""
    if not os.path.exists(socket_path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(socket_path)
    except OSError:
        os.unlink(socket_path)
        logger.info("removed the stale socket %s", socket_path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"a daemon is already serving on {socket_path}; stop it first")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    from sglang.srt.utils import kill_itself_when_parent_died

    # As sglang's run_weight_cache_daemon does (UPSTREAM_LINES): die with the parent.
    kill_itself_when_parent_died()
    from sglang_integration.daemon.hooks import install_daemon_hooks
    from sglang_integration.daemon.layout_side import set_daemon_layout

    geometry = Geometry(
        num_layers=args.num_layers,
        num_physical_slots=args.num_physical_experts,
        num_logical_experts=args.num_logical_experts,
    )
    cache_config = model_less_cache_config(geometry)
    daemon = build_model_less_daemon(args.socket, cache_config)
    if not args.without_plugin:
        install_daemon_hooks()
        try:
            service, ledger = open_layout_service(args, geometry, cache_config)
        except LedgerError as exc:
            logger.error("cannot open the expert layout ledger: %s", exc)
            return 2
        except ExpertFilesError as exc:
            logger.error("cannot serve the expert files: %s", exc)
            return 2
        set_daemon_layout(daemon, service, ledger, args.request_timeout)
    try:
        remove_stale_socket(args.socket)
        daemon.serve()
    except BaseException:
        if not args.without_plugin:
            from sglang_integration.daemon.layout_side import close_daemon_layout

            close_daemon_layout(daemon)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
