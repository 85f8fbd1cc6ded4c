"""``python -m sglang_integration.daemon``: sglang's weight cache daemon with the layout hooks.

Takes the same arguments as ``python -m sglang.srt.weight_cache.daemon`` (the worker flags
``--gpu-id``, ``--tp-rank``, ``--pp-rank``, ``--dist-init-method``, ``--timeout``, ``--force`` and
every server argument) plus the ledger flags below, installs the daemon hooks
(``daemon_hooks.install_daemon_hooks``) and runs sglang's own entry points: one daemon
(``run_weight_cache_daemon``) with ``--gpu-id``/``--tp-rank``, else this node's whole group
(``launch_weight_cache_daemons``), whose spawned children install the hooks themselves through
the spawn hook.

sglang's module cannot be run with ``runpy``: that would execute a second copy of
``weight_cache/daemon.py`` whose ``WeightCacheDaemon`` class is not the hooked one. ``main``
therefore repeats its ``__main__`` block (daemon.py:889-926) against the imported module.

Ledger flags (each also settable by environment, see ``ledger_paths`` and ``content_settings``):
  --expert-layout-ledger TEMPLATE     ledger path template with {device_uuid}
  --expert-layout-keep-versions N     history kept per incarnation (rows of the last N versions)
  --expert-layout-prune-every N       prune automatically every N commits
  --expert-layout-request-timeout S   seconds a client has for its request, and for its reply
  --expert-layout-content-check MODE  enforce (default), warn or off: slot fingerprints
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sglang_integration import settings
from sglang_integration.daemon import hooks as daemon_hooks


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

    # sglang 0.5.23's __main__ block (see the module docstring), unchanged.
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
