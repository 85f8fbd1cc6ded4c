"""A checkpoint file on a mount that stalls: a real FUSE mount over one file, for tests and the
heal campaign.

    python -m sglang_integration.testing.stalled_mount FILE --mode blocked|slow|denied \\
        [--delay SECONDS]

mounts a FUSE file system (``/dev/fuse``, the kernel's own protocol, spoken here in a hundred
lines: no libfuse) over ``FILE`` itself, a regular file, so that every process that opens the
path from then on reads through it, as a checkpoint on a stalled NFS, FUSE or object-store mount
is read. It serves the bytes ``FILE`` held (read through a descriptor opened before the mount),
and answers:

- ``blocked``: stat and open as the file is; every read is taken and never answered (a server
  that stopped answering: the reading process sleeps in the kernel, and a SIGKILL does not wake
  it until the mount goes away, as on a hard NFS mount);
- ``slow``: every read answered after ``--delay`` seconds (a slow disk or a congested mount);
- ``denied``: every open refused with ``EACCES`` (a file the daemon may not read).

It prints ``mounted`` once the mount exists, then serves until SIGTERM or SIGINT, when it
unmounts (lazily) and closes its ``/dev/fuse`` descriptor, which fails every read still waiting
(``ENOTCONN``) and frees the processes sleeping in them. ``stalled_file`` runs it from Python.
Linux only, as root (``mount(2)``); ``fuse_available`` says whether this machine can.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

MODES = ("blocked", "slow", "denied")

# Opcodes and structures of the kernel's FUSE protocol (include/uapi/linux/fuse.h).
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 18, 25, 26
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ...
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHII6I")
ATTR_OUT = struct.Struct("<QII QQQQQQ IIIIIIIIII".replace(" ", ""))
OPEN_OUT = struct.Struct("<QIi")
READ_IN = struct.Struct("<QQII")  # fh, offset, size, read_flags (the rest is not needed)
FOPEN_DIRECT_IO = 1  # every read comes to the server, none from the page cache
BUFFER = (1 << 20) + 4096


def fuse_available() -> str | None:
    """None when this process can mount FUSE file systems, else why not."""
    if sys.platform != "linux":
        return "FUSE mounts need Linux"
    if os.geteuid() != 0:
        return "mount(2) needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"/dev/fuse cannot be opened: {exc.strerror}"
    return None


class StalledFile:
    """The FUSE server of one file (``serve`` until ``stop``)."""

    def __init__(self, path: str, mode: str, delay: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.path = os.path.abspath(path)
        self.mode = mode
        self.delay = delay
        self.source = os.open(self.path, os.O_RDONLY)  # the bytes, from under the mount
        info = os.fstat(self.source)
        self.size = info.st_size
        self.mtime = int(info.st_mtime)
        self.fuse = os.open("/dev/fuse", os.O_RDWR)
        self.stopping = threading.Event()

    def mount(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        options = f"fd={self.fuse},rootmode=100000,user_id=0,group_id=0,allow_other".encode()
        if libc.mount(b"stalled", self.path.encode(), b"fuse.stalled", 0, options) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"mount over {self.path}: {os.strerror(code)}")

    def unmount(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.path.encode(), 2)  # MNT_DETACH
        with contextlib.suppress(OSError):
            os.close(self.fuse)  # aborts the connection: waiting reads fail, their readers wake
        with contextlib.suppress(OSError):
            os.close(self.source)

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                data = os.read(self.fuse, BUFFER)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            length, opcode, unique, _node, *_ = IN_HEADER.unpack_from(data)
            body = data[IN_HEADER.size : length]
            if opcode in NO_REPLY:
                continue
            self._answer(opcode, unique, body)

    def _answer(self, opcode: int, unique: int, body: bytes) -> None:
        if opcode == INIT:
            _, _, readahead, _ = INIT_IN.unpack_from(body)
            self._reply(
                unique, 0, INIT_OUT.pack(7, 31, readahead, 0, 0, 0, 4096, 1, 0, 0, 0, 0, *[0] * 6)
            )
        elif opcode == GETATTR:
            now = self.mtime
            attr = ATTR_OUT.pack(
                0, 0, 0,  # attr_valid: not cached, every stat comes here
                1, self.size, (self.size + 511) // 512, now, now, now, 0, 0, 0,
                0o100444, 1, 0, 0, 0, 4096, 0,
            )  # fmt: skip
            self._reply(unique, 0, attr)
        elif opcode == OPEN:
            if self.mode == "denied":
                self._reply(unique, -errno.EACCES)
            else:
                self._reply(unique, 0, OPEN_OUT.pack(1, FOPEN_DIRECT_IO, 0))
        elif opcode == READ:
            if self.mode == "blocked":
                return  # taken, never answered
            _, offset, size, _ = READ_IN.unpack_from(body)
            if self.mode == "slow":
                threading.Thread(
                    target=self._slow_read, args=(unique, offset, size), daemon=True
                ).start()
                return
            self._reply(unique, 0, os.pread(self.source, size, offset))
        elif opcode in (RELEASE, FLUSH, DESTROY):
            self._reply(unique, 0)
        else:
            self._reply(unique, -errno.ENOSYS)

    def _slow_read(self, unique: int, offset: int, size: int) -> None:
        time.sleep(self.delay)
        self._reply(unique, 0, os.pread(self.source, size, offset))

    def _reply(self, unique: int, error: int, payload: bytes = b"") -> None:
        with contextlib.suppress(OSError):  # ENOENT: the request was interrupted meanwhile
            os.write(
                self.fuse, OUT_HEADER.pack(OUT_HEADER.size + len(payload), error, unique) + payload
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_integration.testing.stalled_mount")
    parser.add_argument("file")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds per read (slow)")
    args = parser.parse_args(argv)
    problem = fuse_available()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    served = StalledFile(args.file, args.mode, args.delay)

    def stop(signum: int, frame: object) -> None:
        served.stopping.set()
        served.unmount()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    served.mount()
    print("mounted", flush=True)
    served.serve()
    served.unmount()
    return 0


@contextlib.contextmanager
def stalled_file(path: str | os.PathLike[str], mode: str, delay: float = 1.0) -> Iterator[None]:
    """``path`` on a stalled mount (``mode``) while the block runs; unmounted after."""
    target = os.fspath(Path(path).resolve())
    server = subprocess.Popen(
        [sys.executable, "-m", __name__, target, "--mode", mode, "--delay", str(delay)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline() if server.stdout is not None else ""
        if line.strip() != "mounted":
            raise RuntimeError(f"the stalled mount over {target} did not start ({line!r})")
        yield
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        ctypes.CDLL(None, use_errno=True).umount2(target.encode(), 2)  # if still mounted


if __name__ == "__main__":
    sys.exit(main())
