"""The one rule for connecting to a daemon's control socket: only a socket node this user owns.

Both sides that connect (an engine rank, the CLI's cordon) check the node before they connect,
so that a file or another user's socket planted at the path is never spoken to.
"""

from __future__ import annotations

import os
import stat

from layout_ledger.wire.protocol import Outcome, Reply


def socket_node_problem(socket_path: str) -> Reply | None:
    """None for a socket node owned by this user; else why not to connect (``NO_DAEMON`` when
    nothing is there, ``UNREACHABLE`` otherwise)."""
    try:
        node = os.lstat(socket_path)
    except FileNotFoundError:
        return Reply(Outcome.NO_DAEMON, f"no daemon socket at {socket_path}")
    except OSError as exc:
        return Reply(Outcome.UNREACHABLE, f"cannot stat the daemon socket {socket_path}: {exc}")
    if not stat.S_ISSOCK(node.st_mode) or node.st_uid != os.getuid():
        return Reply(
            Outcome.UNREACHABLE,
            f"refusing to connect: {socket_path} is not a socket owned by this user",
        )
    return None
