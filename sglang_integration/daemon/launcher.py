"""``python -m sglang_integration.daemon``: sglang's weight cache daemon with the layout hooks.

It takes ``python -m sglang.srt.weight_cache.daemon``'s arguments plus the ``--expert-layout-*``
flags (``settings``), installs the daemon hooks and runs sglang's own entry points: one daemon
(``run_weight_cache_daemon``) with ``--gpu-id``/``--tp-rank``, else this node's whole group
(``launch_weight_cache_daemons``), whose spawned children install the hooks through the spawn
hook. sglang's module cannot be run with ``runpy`` (a second copy of ``weight_cache/daemon.py``
would hold an unhooked ``WeightCacheDaemon``), so ``main`` repeats its ``__main__`` block
(``UPSTREAM_LINES``) against the imported module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sglang_integration import settings
from sglang_integration.daemon import hooks as daemon_hooks
from sglang_integration.upstream_lines import UpstreamLine

_DAEMON_FILE = "srt/weight_cache/daemon.py"
# sglang's __main__ block, which main repeats (tests/test_upstream_lines.py checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(_DAEMON_FILE, 889, 'if __name__ == "__main__":', "the block main repeats"),
    UpstreamLine(
        _DAEMON_FILE, 891, "WeightCacheDaemonArgs.add_cli_args(worker_parser)", "worker flags"
    ),
    UpstreamLine(
        _DAEMON_FILE, 896, "server_args = prepare_server_args(server_argv)", "server arguments"
    ),
    UpstreamLine(
        _DAEMON_FILE,
        898,
        "if daemon_args.gpu_id is not None or daemon_args.tp_rank is not None:",
        "one daemon with --gpu-id/--tp-rank, else the node's group",
    ),
    UpstreamLine(_DAEMON_FILE, 909, "cleanup_stale_daemon_files(", "one daemon's stale files"),
    UpstreamLine(_DAEMON_FILE, 913, "run_weight_cache_daemon(", "one daemon"),
    UpstreamLine(_DAEMON_FILE, 921, "launch_weight_cache_daemons(", "the node's group"),
)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ledger_parser = argparse.ArgumentParser(
        prog="python -m sglang_integration.daemon",
        add_help=False,
        description="sglang's weight cache daemon with the expert layout ledger. Every other "
        "argument is python -m sglang.srt.weight_cache.daemon's.",
    )
    settings.add_daemon_flags(ledger_parser)
    if "-h" in argv or "--help" in argv:
        ledger_parser.print_help()
        print()
    ledger_args, rest = ledger_parser.parse_known_args(argv)
    try:
        settings.export_daemon_flags(ledger_args)
    except settings.SettingError as exc:
        ledger_parser.error(str(exc))
    daemon_hooks.install_daemon_hooks()

    # sglang's __main__ block (UPSTREAM_LINES), unchanged.
    from sglang.srt.platforms import current_platform
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.weight_cache import daemon as sglang_daemon
    from sglang.srt.weight_cache.protocol import cleanup_stale_daemon_files

    worker_parser = argparse.ArgumentParser(add_help=False)
    sglang_daemon.WeightCacheDaemonArgs.add_cli_args(worker_parser)
    worker_ns, server_argv = worker_parser.parse_known_args(rest)
    server_args = prepare_server_args(server_argv)
    daemon_args = sglang_daemon.WeightCacheDaemonArgs.from_cli_args(worker_ns)
    if daemon_args.gpu_id is not None or daemon_args.tp_rank is not None:
        gpu_id = daemon_args.gpu_id if daemon_args.gpu_id is not None else daemon_args.tp_rank
        tp_rank = daemon_args.tp_rank if daemon_args.tp_rank is not None else daemon_args.gpu_id
        cleanup_stale_daemon_files(
            current_platform.get_device_uuid(gpu_id), force=daemon_args.force
        )
        sglang_daemon.run_weight_cache_daemon(
            server_args,
            gpu_id=gpu_id,
            tp_rank=tp_rank,
            pp_rank=daemon_args.pp_rank,
            dist_init_method=daemon_args.dist_init_method,
        )
    else:
        sglang_daemon.launch_weight_cache_daemons(
            server_args,
            dist_init_method=daemon_args.dist_init_method,
            timeout=daemon_args.timeout,
            force=daemon_args.force,
        )


if __name__ == "__main__":
    main()
