"""Is the daemon that wrote an incarnation still running?

The daemon that owns a ledger holds its writer lock for its whole life, and the kernel drops it
however the daemon dies (``store.connections.WriterLock``). The lock is the kernel's, on the
file's inode: every process on this kernel sees it, whatever container or mount namespace it
runs in and whatever host name the daemon recorded, through any path or read-only mount of the
file. So for the latest incarnation, not yet ended, the lock says it, probed without being taken
(``writer_lock_held``), so asking never disturbs the daemon (``daemon_liveness``).

What stays unknowable here: a free lock on a network filesystem (NFS, SMB, 9p, FUSE...), where a
daemon on another host may hold the lock on its own kernel (a file on that host's disk, read over
the network); and a file the probe cannot open.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from layout_ledger.store.connections import lock_holder_pid, writer_lock_held
from layout_ledger.store.rows import Incarnation


@dataclass(frozen=True)
class Liveness:
    """Whether an incarnation's daemon runs (None: cannot tell here) and, in words, why."""

    alive: bool | None
    detail: str


NO_CLEAN_END = "not running, no clean end recorded"

# Filesystems whose files another host's kernel may lock: a lock free here says nothing there.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "afs",
        "beegfs",
        "virtiofs",
    }
)
# FUSE filesystems are taken as network ones (sshfs, s3fs, ...) but for these local ones.
LOCAL_FUSE = frozenset({"fuse.fuse-overlayfs", "fuse.lxcfs"})


def daemon_liveness(
    path: str | os.PathLike[str],
    inc: Incarnation,
    *,
    latest: bool,
    this_host: str | None = None,
    mountinfo: str | None = None,
) -> Liveness:
    """Whether the daemon of ``inc`` (an incarnation of the ledger at ``path``) is running;
    ``latest`` says whether it is the ledger's newest incarnation.

    An ended incarnation, or one a later incarnation followed, is not running. Else the writer
    lock of the file ``path`` names (a symbolic link resolved) is probed: held by the recorded
    daemon, running; held by another process (``layout-ledger prune`` or ``upgrade``, which
    take it only while no daemon does; the holder's pid is in ``<ledger>.lock``), not its daemon
    running; free, not running, except on a network filesystem, where a daemon recorded on
    another host may hold it unseen (unknown, ``alive`` None, as for a file the probe cannot
    open). ``this_host`` and ``mountinfo`` (``/proc/self/mountinfo``'s text) are for tests.
    """
    if inc.ended_at is not None:
        return Liveness(False, f"not running, ended {inc.end_state}")
    if not latest:
        return Liveness(False, f"{NO_CLEAN_END}; a later incarnation started")
    real = Path(os.path.realpath(path))
    held = writer_lock_held(real)
    if held is None:
        return Liveness(None, "unknown: the file could not be opened to probe its writer lock")
    if held:
        holder, daemon = lock_holder_pid(real), inc.origin.pid
        if holder is not None and daemon is not None and holder != daemon:
            return Liveness(
                False,
                f"{NO_CLEAN_END}; pid {holder}, not its daemon (pid {daemon}), holds the writer "
                f"lock",
            )
        return Liveness(True, "running")
    network = network_filesystem(real, mountinfo)
    here = socket.gethostname() if this_host is None else this_host
    recorded = inc.origin.host
    if network is not None and recorded != here:
        where = "another host" if recorded is None else f"host {recorded}"
        return Liveness(
            None,
            f"unknown: the file is on a network filesystem ({network}) and its daemon ran on "
            f"{where}, whose lock this host may not see",
        )
    return Liveness(False, NO_CLEAN_END)


def network_filesystem(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the network filesystem ``path`` (resolved) lies on; None for a local one or
    when the mount table cannot be read."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
                mountinfo = table.read()
        except OSError:
            return None
    fstype = _filesystem_type(os.fspath(path), mountinfo)
    if fstype is None:
        return None
    base = fstype.split(".", 1)[0]
    remote = base in NETWORK_FILESYSTEMS or (base == "fuse" and fstype not in LOCAL_FUSE)
    return fstype if remote else None


def _filesystem_type(path: str, mountinfo: str) -> str | None:
    """The filesystem type of the longest mount point above ``path`` (the last one mounted
    there wins, as the kernel's does)."""
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return None if best is None else best[1]


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) undone."""
    out, index = [], 0
    while index < len(field):
        if field[index] == "\\" and field[index + 1 : index + 4].isdigit():
            out.append(chr(int(field[index + 1 : index + 4], 8)))
            index += 4
        else:
            out.append(field[index])
            index += 1
    return "".join(out)
