"""Reading a checkpoint's tensors in a child process, within a deadline: no checkpoint read can
stop the daemon.

A daemon reads its checkpoint after the load for heals, reloads and the load-time check that a
raw reload is right (``checkpoint_reload``). A file that blocks (a FIFO in place of a shard; a
stalled NFS, FUSE or object-store mount under the checkpoint) used to block the daemon's own
``safetensors.safe_open``, which holds the GIL while it opens and maps the file: every thread of
the daemon stopped, its requests timed out and SIGTERM did nothing. Here the reads run in a
child process, one per reloader call, that imports nothing but the standard library (one is
kept started ahead, so a heal waits for no interpreter):

- it opens each file ``O_NONBLOCK`` and refuses anything ``fstat`` does not call a regular file
  (a FIFO, a device, a directory) before a byte is read, naming what it is;
- it parses the safetensors header itself (8 bytes of little-endian length, the JSON header,
  bounded) and copies each tensor's bytes into a memfd the daemon gave it (``sendfile``, so the
  bytes are copied once, in the kernel); the daemon maps the memfd and builds its tensors on it;
- it names every failure's cause: ``os.strerror`` of the errno (``Permission denied`` is not
  ``No such file or directory``), a truncated file, a header that does not hold a tensor.

The daemon waits for each step (the index; then each layer, on its command, so at most one
layer's bytes exist at a time) with ``ReadDeadline`` seconds (``--expert-layout-heal-timeout``);
a child past it is SIGKILLed and the read fails naming the file it was in and the deadline. The
daemon only waits on a socket, which releases the GIL, and holds no lock of its record while it
waits (``LayoutRecord.heal``). ``cancel`` kills every child at once (SIGTERM: the daemon stops
within seconds during any read).

The protocol (one JSON object per ``SOCK_SEQPACKET`` datagram, a memfd as ``SCM_RIGHTS``):
daemon -> child ``{"op": "index", "directory", "max_index_bytes"}``, then per layer
``{"op": "layer", "prefixes": [...]}`` with its memfd, then ``{"op": "done"}``; child -> daemon
``{"op": "file", "path"}`` before each file it opens, ``{"op": "tensors", "entries"}`` (at most
``ENTRIES_PER_MESSAGE`` each), ``{"op": "indexed", "bytes"}`` / ``{"op": "layer", "bytes",
"size"}`` at the end of a step, or ``{"op": "error", "message"}``.

Run as ``python -S -E -P .../checkpoint_reads.py FD`` by ``ChildReader`` only (one child is
started ahead, so a heal does not wait for an interpreter). This module imports only the
standard library at its top (torch in the daemon's functions only).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
# The index is read from a directory this daemon does not own: bounded before it is parsed
# (DeepSeek-V3's is about 9 MB).
MAX_INDEX_BYTES = 64 * 1024 * 1024
# A safetensors header is bounded by its format (100 MB); refuse more before reading it.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_MESSAGE = 1 << 20  # one datagram of the protocol
ENTRIES_PER_MESSAGE = 200  # tensor descriptions per "tensors" message
ALIGN = 64  # each tensor's bytes start at a multiple of this in the memfd
COPY_CHUNK = 64 * 1024 * 1024
# Seconds to wait for a SIGKILLed child to be reaped: a child asleep in a read of a hard-mounted
# file does not die until the mount answers (the kernel's "wait it out"); it is left to
# subprocess's own reaping then, and the daemon goes on.
KILL_WAIT = 0.5

# safetensors dtype -> bytes per element (the child checks each tensor's length with it).
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class ReadFailed(Exception):
    """A checkpoint read that failed: its cause in words, and the file it was reading (None:
    before any file). ``checkpoint_reload`` turns it into the daemon's ``ReloadFailed``."""

    def __init__(self, cause: str, path: str | None = None) -> None:
        super().__init__(cause if path is None else f"{path}: {cause}")
        self.cause = cause
        self.path = path


@dataclass(frozen=True)
class TensorEntry:
    """One tensor read into the memfd: its name, dtype, shape, and where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# --- the child ------------------------------------------------------------------------------


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.send(json.dumps(message, separators=(",", ":")).encode())


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _os_error(path: str, exc: OSError) -> ReadFailed:
    name = errno.errorcode.get(exc.errno or 0, "")
    cause = os.strerror(exc.errno) if exc.errno else str(exc)
    return ReadFailed(cause + (f" ({name})" if name else ""), path)


def open_regular(path: str) -> tuple[int, int]:
    """Open ``path`` for reading without blocking on it; (fd, size) of a regular file, else
    ``ReadFailed`` naming what it is (a FIFO opened this way does not wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise _os_error(path, exc) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReadFailed(
                f"it is {_kind(info.st_mode)}, not a regular file: refused without reading it, "
                f"a read could block",
                path,
            )
        os.set_blocking(fd, True)
    except OSError as exc:
        os.close(fd)
        raise _os_error(path, exc) from None
    except ReadFailed:
        os.close(fd)
        raise
    return fd, info.st_size


def _pread_exact(fd: int, size: int, offset: int, path: str) -> bytes:
    data = b""
    while len(data) < size:
        try:
            chunk = os.pread(fd, size - len(data), offset + len(data))
        except OSError as exc:
            raise _os_error(path, exc) from None
        if not chunk:
            raise ReadFailed(
                f"it ends at byte {offset + len(data)}, before the {size} bytes expected from "
                f"byte {offset} (a truncated file?)",
                path,
            )
        data += chunk
    return data


def read_index(directory: str, limit: int = MAX_INDEX_BYTES) -> tuple[dict[str, str], int]:
    """The index's ``weight_map`` and its size in bytes."""
    path = os.path.join(directory, INDEX_FILE)
    fd, size = open_regular(path)
    try:
        if size > limit:
            raise ReadFailed(f"it is larger than {limit} bytes; not an index", path)
        raw = _pread_exact(fd, size, 0, path)
    finally:
        os.close(fd)
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise ReadFailed("it is not a safetensors index (no weight_map)", path) from None
    if not isinstance(weight_map, dict):
        raise ReadFailed("its weight_map is not an object", path)
    return weight_map, size


def files_of(weight_map: Mapping[str, Any], prefixes: Sequence[str]) -> dict[str, list[str]]:
    """File -> the names of the tensors starting with one of ``prefixes`` it holds."""
    chosen = tuple(prefixes)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(name, str) or not name.startswith(chosen):
            continue
        if not isinstance(file, str) or "/" in file or file.startswith(".") or "\0" in file:
            raise ReadFailed(
                f"the index names an unsafe file for tensor {name[:128]!r}; refusing it"
            )
        by_file.setdefault(file, []).append(name)
    return by_file


def _header(fd: int, size: int, path: str) -> tuple[dict[str, Any], int]:
    if size < 8:
        raise ReadFailed(f"it is {size} bytes long, too short for a safetensors header", path)
    length = int.from_bytes(_pread_exact(fd, 8, 0, path), "little")
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise ReadFailed(
            f"it is not a safetensors file (its header length {length} does not fit in its "
            f"{size} bytes)",
            path,
        )
    try:
        header = json.loads(_pread_exact(fd, length, 8, path))
    except ValueError:
        raise ReadFailed("it is not a safetensors file (its header is not JSON)", path) from None
    if not isinstance(header, dict):
        raise ReadFailed("it is not a safetensors file (its header is not an object)", path)
    return header, 8 + length


def _describe(header: Mapping[str, Any], name: str, path: str, data_bytes: int) -> Any:
    meta = header.get(name)
    if not isinstance(meta, dict):
        raise ReadFailed(
            f"it does not hold tensor {name[:128]!r}, which the index places there", path
        )
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise ReadFailed(f"its tensor {name[:128]!r} has dtype {str(dtype)[:32]!r}, unknown", path)
    if not (
        isinstance(shape, list)
        and all(isinstance(x, int) and x >= 0 for x in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(x, int) for x in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise ReadFailed(f"its tensor {name[:128]!r} has a malformed header entry", path)
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise ReadFailed(
            f"its tensor {name[:128]!r} spans {end - begin} bytes, not the "
            f"{math.prod(shape) * DTYPE_SIZES[dtype]} its dtype and shape need",
            path,
        )
    if end > data_bytes:
        raise ReadFailed(
            f"it holds {data_bytes} bytes of tensor data, but its header places tensor "
            f"{name[:128]!r} up to byte {end} (a truncated file?)",
            path,
        )
    return dtype, shape, begin, end


def _copy(src: int, src_offset: int, dst: int, dst_offset: int, count: int, *, path: str) -> None:
    """``count`` bytes of ``src`` from ``src_offset`` into ``dst`` at ``dst_offset``."""
    done = 0
    use_sendfile = True
    while done < count:
        step = min(COPY_CHUNK, count - done)
        if use_sendfile:
            try:
                os.lseek(dst, dst_offset + done, os.SEEK_SET)
                sent = os.sendfile(dst, src, src_offset + done, step)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EOPNOTSUPP):
                    use_sendfile = False  # a file system without splice: read and write
                    continue
                raise _os_error(path, exc) from None
            if sent == 0:
                raise ReadFailed(
                    f"it ends at byte {src_offset + done}, before the tensor bytes its header "
                    f"places there (a truncated file?)",
                    path,
                )
            done += sent
            continue
        data = _pread_exact(src, step, src_offset + done, path)
        os.pwrite(dst, data, dst_offset + done)
        done += len(data)


def read_layer(
    sock: socket.socket, directory: str, by_file: Mapping[str, Sequence[str]], memfd: int
) -> tuple[int, int]:
    """Copy the named tensors into ``memfd``, describing them on ``sock``; (bytes, size)."""
    entries: list[list[Any]] = []
    offset = 0
    read = 0
    for file in sorted(by_file):
        path = os.path.join(directory, file)
        _send(sock, {"op": "file", "path": path})
        fd, size = open_regular(path)
        try:
            header, data_start = _header(fd, size, path)
            for name in sorted(by_file[file]):
                dtype, shape, begin, end = _describe(header, name, path, size - data_start)
                offset = -(-offset // ALIGN) * ALIGN
                _copy(fd, data_start + begin, memfd, offset, end - begin, path=path)
                entries.append([name, dtype, shape, offset, end - begin])
                offset += end - begin
                read += end - begin
        finally:
            os.close(fd)
    for start in range(0, len(entries), ENTRIES_PER_MESSAGE):
        _send(sock, {"op": "tensors", "entries": entries[start : start + ENTRIES_PER_MESSAGE]})
    return read, offset


def child_main(fd: int) -> int:
    """The child: serve the daemon's commands on the inherited socket ``fd`` until done."""
    sock = socket.socket(fileno=fd)
    weight_map: dict[str, str] = {}
    directory = ""
    while True:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not data:
            return 0
        command = json.loads(data)
        op = command.get("op")
        try:
            if op == "index":
                directory = str(command["directory"])
                weight_map, size = read_index(directory, int(command["max_index_bytes"]))
                _send(sock, {"op": "indexed", "bytes": size})
            elif op == "layer":
                if len(fds) != 1:
                    raise ReadFailed("a layer command came without its memfd")
                by_file = files_of(weight_map, command["prefixes"])
                try:
                    read, size = read_layer(sock, directory, by_file, fds[0])
                finally:
                    os.close(fds[0])
                _send(sock, {"op": "layer", "bytes": read, "size": size, "files": len(by_file)})
            else:
                return 0
        except ReadFailed as exc:
            _send(sock, {"op": "error", "cause": exc.cause, "path": exc.path})
            return 1
        except Exception as exc:  # whatever it is, the daemon gets its words
            _send(sock, {"op": "error", "cause": f"{type(exc).__name__}: {str(exc)[:300]}"})
            return 1


# --- the daemon's side ----------------------------------------------------------------------


class ChildReader:
    """Starts a reader child per read session; ``cancel`` stops every one (SIGTERM).

    One child is kept started ahead (``_spare``: an interpreter without ``site``, waiting on its
    socket, about 10 MB), so a heal does not wait for a process to start: each session takes it,
    and starts the next one when it closes (the load-time reload check's session starts the
    first)."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"the read deadline must be positive, got {timeout}")
        self.timeout = timeout
        self._children: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._cancelled = False
        self._spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None

    def session(self, directory: str) -> ReadSession:
        """A child reading from ``directory``, its index read (within the deadline)."""
        started = time.monotonic()
        with self._lock:
            if self._cancelled:
                raise ReadFailed("the daemon is stopping; no checkpoint read starts now")
            spare, self._spare = self._spare, None
        if spare is None or spare[0].poll() is not None:
            if spare is not None:
                spare[1].close()
            spare = self._start()
        process, parent = spare
        session = ReadSession(self, process, parent, directory, started + self.timeout)
        try:
            session.read_index()
        except BaseException:
            session.close()
            raise
        return session

    def _start_spare(self) -> None:
        with self._lock:
            if self._spare is not None or self._cancelled:
                return
        try:
            spare = self._start()
        except ReadFailed:
            return  # the next session starts its own, and names the failure
        with self._lock:
            if self._spare is None and not self._cancelled:
                self._spare = spare
                return
        _kill(spare[0])
        spare[1].close()
        self._forget(spare[0])

    def _start(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """A child waiting on its end of a new socket pair: no ``site`` (``-S``), no
        environment (``-E``), no script directory on its path (``-P``): the standard library
        only, as this module needs."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = subprocess.Popen(
                [sys.executable, "-S", "-E", "-P", __file__, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:
            parent.close()
            raise ReadFailed(f"the checkpoint reader could not start ({exc})") from None
        finally:
            child.close()
        with self._lock:
            self._children.add(process)
        return process, parent

    def cancel(self) -> None:
        """Kill every reader child now; no read starts from here on."""
        with self._lock:
            self._cancelled = True
            children = list(self._children)
            spare, self._spare = self._spare, None
        for process in children:
            _kill(process)
        if spare is not None:
            spare[1].close()

    def _forget(self, process: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._children.discard(process)

    @property
    def cancelled(self) -> bool:
        return self._cancelled


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


class ReadSession:
    """One child: the index read, then one layer at a time (``read_layer``)."""

    def __init__(
        self,
        reader: ChildReader,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        directory: str,
        first_deadline: float,
    ) -> None:
        self.reader = reader
        self.process = process
        self.sock = sock
        self.directory = directory
        self.index_bytes = 0
        self._where = os.path.join(directory, INDEX_FILE)
        # The index and the first layer share one deadline from the session's start (a heal of
        # one blocked layer fails within the deadline of its start); each later layer has its own.
        self._first_deadline: float | None = first_deadline

    def read_index(self) -> None:
        self._send({"op": "index", "directory": self.directory, "max_index_bytes": MAX_INDEX_BYTES})
        reply = self._until(("indexed",), self._deadline())[-1]
        self.index_bytes = int(reply["bytes"])

    def _deadline(self) -> float:
        if self._first_deadline is not None:
            return self._first_deadline
        return time.monotonic() + self.reader.timeout

    def read_layer(self, prefixes: Sequence[str]) -> tuple[list[TensorEntry], Any, int, int]:
        """The tensors whose names start with ``prefixes``: (entries, their mmap, bytes read,
        files read). The entries' bytes live in the mmap until it is closed."""
        import mmap

        memfd = os.memfd_create("expert-layout-read", os.MFD_CLOEXEC)
        try:
            payload = json.dumps({"op": "layer", "prefixes": list(prefixes)}).encode()
            self._where = self.directory  # until the child names the file it opens
            try:
                socket.send_fds(self.sock, [payload], [memfd])
            except OSError as exc:
                raise self._failed(f"the checkpoint reader is gone ({exc})") from None
            messages = self._until(("layer",), self._deadline())
            self._first_deadline = None
            done = messages[-1]
            entries = [
                TensorEntry(str(name), str(dtype), tuple(int(x) for x in shape), int(off), int(n))
                for message in messages
                if message.get("op") == "tensors"
                for name, dtype, shape, off, n in message["entries"]
            ]
            size = int(done["size"])
            mapped = mmap.mmap(memfd, size) if size else None
            return entries, mapped, int(done["bytes"]), int(done["files"])
        finally:
            os.close(memfd)

    def close(self) -> None:
        """Tell the child to end; it is reaped later (subprocess reaps a dropped child at its
        next start), so closing waits for no interpreter's exit."""
        try:
            if self.process.poll() is None:
                with contextlib.suppress(OSError):
                    self.sock.send(json.dumps({"op": "done"}).encode())
        finally:
            self.sock.close()
            self.reader._forget(self.process)
            # The next spare starts on a thread of its own: the heal does not wait for a fork.
            threading.Thread(target=self.reader._start_spare, daemon=True).start()

    def _send(self, message: Mapping[str, Any]) -> None:
        try:
            _send(self.sock, message)
        except OSError as exc:
            raise self._failed(f"the checkpoint reader is gone ({exc})") from None

    def _until(self, ends: tuple[str, ...], deadline: float) -> list[dict[str, Any]]:
        """The child's messages up to one whose op is in ``ends`` (within ``deadline``)."""
        messages: list[dict[str, Any]] = []
        while True:
            remaining = deadline - time.monotonic()
            if self.reader.cancelled:
                _kill(self.process)
                _reap(self.process)
                raise ReadFailed("the daemon is stopping, its read was stopped", self._where)
            if remaining <= 0:
                _kill(self.process)
                _reap(self.process)
                raise ReadFailed(
                    f"no answer within the deadline of {self.reader.timeout:g} s "
                    f"(--expert-layout-heal-timeout), the reader was killed: is it on a mount "
                    f"that stopped answering?",
                    self._where,
                )
            self.sock.settimeout(min(remaining, 0.5))  # wakes for cancel
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except TimeoutError:
                continue
            except OSError as exc:
                raise self._failed(f"the checkpoint reader failed ({exc})") from None
            if not data:
                raise self._failed("the checkpoint reader ended without an answer")
            message = json.loads(data)
            if message.get("op") == "error":
                _reap(self.process)
                path = message.get("path")
                raise ReadFailed(str(message.get("cause")), None if path is None else str(path))
            if message.get("op") == "file":
                self._where = str(message.get("path"))
            messages.append(message)
            if message.get("op") in ends:
                return messages

    def _failed(self, what: str) -> ReadFailed:
        _kill(self.process)
        code = _reap(self.process)
        return ReadFailed(f"{what}, exit code {code}", self._where)


def _reap(process: subprocess.Popen[bytes]) -> int | None:
    try:
        return process.wait(KILL_WAIT)
    except subprocess.TimeoutExpired:
        return None  # in the kernel still (an uninterruptible read): reaped at its end


# safetensors dtype -> torch dtype name (looked up on torch when tensors are built).
TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}


def tensors_of(entries: Sequence[TensorEntry], mapped: Any) -> list[tuple[str, Any]]:
    """Torch tensors on the mmap's bytes (views: keep the mmap open while they are used)."""
    import torch

    tensors = []
    for entry in entries:
        dtype = getattr(torch, TORCH_DTYPES[entry.dtype], None)
        if dtype is None:
            raise ReadFailed(
                f"tensor {entry.name[:128]!r} has dtype {entry.dtype}, unknown to torch"
            )
        if entry.nbytes == 0:
            tensors.append((entry.name, torch.empty(entry.shape, dtype=dtype)))
            continue
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
        tensors.append((entry.name, raw.view(dtype).reshape(entry.shape)))
    return tensors


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(child_main(int(sys.argv[1])))
