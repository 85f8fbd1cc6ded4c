"""The one-GPU check's stand-in daemon, for a machine where sglang 0.5.23 cannot be imported.

    python -m gpu_single.standin_daemon --socket PATH --ledger PATH \\
        --num-layers L --num-logical-experts E --num-physical-experts P

Takes the model-less daemon's arguments (``python -m sglang_integration.testing.daemon``) and
serves the same protocol from the same code of this package, except three stand-ins, which
the check names in its output whenever this daemon runs:

- sglang's ``WeightCacheDaemon.serve`` loop -> :meth:`StandInDaemon.serve` (the same steps:
  bind with umask 0177, listen, a ready file beside the socket, one connection at a time with a
  30 s timeout, SIGTERM/SIGINT end the loop);
- sglang's ``WeightCacheDaemon._handle_connection`` -> :meth:`StandInDaemon.handle_other`,
  which answers ``ping`` and refuses other types with sglang's "Unknown request type" (it
  serves no tensors and no ``fetch_state``);
- sglang's framing -> ``standin_framing`` (4-byte length + pickle, plain data only).

Not stood in: the ledger (``Ledger``, a real SQLite file), the record and its rules
(``LayoutService``), the attach watcher and this package's connection hook
(``hooks.around_handle_connection``, ``layout_side.set_daemon_layout``,
``record_opening.open_ledger_record``),
which receives every connection exactly as it does inside sglang's daemon.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from gpu_single import standin_framing

logger = logging.getLogger(__name__)

CLIENT_CONNECTION_TIMEOUT = 30.0  # sglang's, per exchange
_PR_SET_PDEATHSIG = 1


class StandInDaemon:
    """What of sglang's ``WeightCacheDaemon`` the hook reads: ``socket_path``, the layout side."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.ready_path = f"{socket_path}.ready"
        self._running = False

    def handle_other(self, conn: Any) -> None:
        """The original handler's replies for what the hook hands on (ping, unknown types)."""
        request = standin_framing.recv_msg(conn)
        kind = request.get("type") if isinstance(request, dict) else None
        if kind == "ping":
            standin_framing.send_msg(conn, {"status": "ok"})
        else:
            standin_framing.send_msg(
                conn, {"status": "error", "message": f"Unknown request type: {kind}"}
            )

    def serve(self) -> None:
        from sglang_integration.daemon.hooks import around_handle_connection

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(8)
        listener.settimeout(1.0)
        with open(self.ready_path, "w") as ready:
            ready.write(f"pid={os.getpid()}\nstand-in daemon of the one-GPU check\n")
        self._running = True
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        logger.info("stand-in daemon listening on %s", self.socket_path)
        try:
            while self._running:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(CLIENT_CONNECTION_TIMEOUT)
                try:
                    around_handle_connection(StandInDaemon.handle_other, self, conn)
                except Exception:
                    logger.exception("error handling a connection")
                finally:
                    conn.close()
        finally:
            listener.close()
            for path in (self.socket_path, self.ready_path):
                if os.path.exists(path):
                    os.unlink(path)

    def _stop(self, signum: int, frame: Any) -> None:
        logger.info("received signal %d, shutting down", signum)
        self._running = False


def die_with_parent() -> None:
    """As sglang's ``kill_itself_when_parent_died``: SIGKILL this process when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_single.standin_daemon")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--num-logical-experts", type=int, required=True)
    parser.add_argument("--num-physical-experts", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    die_with_parent()
    standin_framing.install()
    from layout_ledger.core.errors import LedgerError
    from layout_ledger.core.layout import Geometry, trivial_map
    from layout_ledger.wire.service import LayoutService
    from sglang_integration.daemon.layout_side import close_daemon_layout, set_daemon_layout
    from sglang_integration.daemon.record_opening import (
        config_fingerprint,
        daemon_retention,
        open_ledger_record,
    )

    geometry = Geometry(args.num_layers, args.num_physical_experts, args.num_logical_experts)
    initial = trivial_map(args.num_layers, args.num_physical_experts, args.num_logical_experts)
    daemon = StandInDaemon(args.socket)
    try:
        ledger, record = open_ledger_record(
            args.ledger,
            geometry,
            initial,
            retention=daemon_retention(),
            config_fingerprint=config_fingerprint({"stand_in": "one-GPU check", **vars(args)}),
            daemon_label=f"one-GPU check stand-in pid={os.getpid()} socket={args.socket}",
        )
    except LedgerError as exc:
        logger.error("cannot open the expert layout ledger: %s", exc)
        return 2
    set_daemon_layout(daemon, LayoutService(record), ledger)
    try:
        daemon.serve()
    finally:
        close_daemon_layout(daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
