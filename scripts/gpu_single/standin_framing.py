"""A stand-in for sglang's socket framing, for a machine where sglang 0.5.23 cannot be imported.

sglang's ``weight_cache/protocol.py`` frames every control-socket message as a 4-byte
big-endian length and one pickled object, at most 256 MiB, read with sglang's restricted
unpickler. This module restates ``send_msg`` / ``recv_msg`` (its unpickler accepts plain data
only: dicts, lists, tuples, strings, numbers, booleans, None, bytes, which is all the expert
layout protocol sends) and, with :func:`install`, registers them as
``sglang.srt.weight_cache.protocol`` in *this process only*, so that this package's real
engine client (``sglang_integration.engine.client``) and daemon connection hook
(``sglang_integration.daemon.hooks.around_handle_connection``), which import that module when
they send or read a frame, run unchanged over it.

Used only by the one-GPU check's ``--daemon ledger-service`` mode, and said so in its output:
the registered modules carry ``STANDS_IN = True`` and no other sglang attribute, so any other
use of sglang in such a process fails loudly.
"""

from __future__ import annotations

import io
import itertools
import pickle
import socket
import struct
import sys
import types
from typing import Any

MAX_MSG_SIZE = 256 * 1024 * 1024  # sglang's cap
FRAMING_MODULE = "sglang.srt.weight_cache.protocol"
STANDS_IN_FOR = "sglang.srt.weight_cache.protocol.send_msg/recv_msg (framing)"


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds plain data only: any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: plain data only")


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv_msg(sock: Any) -> Any:
    header = _recv_exact(sock, 4)
    if header is None:
        raise ConnectionError("Connection closed while reading message header")
    (length,) = struct.unpack("!I", header)
    if length > MAX_MSG_SIZE:
        raise ValueError(f"Message size {length} exceeds {MAX_MSG_SIZE} byte cap")
    data = _recv_exact(sock, length)
    if data is None:
        raise ConnectionError("Connection closed while reading message body")
    return _PlainDataUnpickler(io.BytesIO(data)).load()


def _recv_exact(sock: Any, size: int) -> bytes | None:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = sock.recv(size - len(buffer))
        if not chunk:
            return None
        buffer.extend(chunk)
    return bytes(buffer)


def install() -> None:
    """Register the stand-in as ``sglang.srt.weight_cache.protocol`` in this process."""
    existing = sys.modules.get("sglang")
    if existing is not None and not getattr(existing, "STANDS_IN", False):
        raise RuntimeError("the real sglang is imported in this process; no stand-in needed")
    names = ["sglang", "sglang.srt", "sglang.srt.weight_cache", FRAMING_MODULE]
    for name in names:
        if name not in sys.modules:
            module = types.ModuleType(name, f"one-GPU check stand-in for {name}")
            module.STANDS_IN = True  # type: ignore[attr-defined]
            module.__path__ = []  # type: ignore[attr-defined]
            sys.modules[name] = module
    framing = sys.modules[FRAMING_MODULE]
    framing.send_msg = send_msg  # type: ignore[attr-defined]
    framing.recv_msg = recv_msg  # type: ignore[attr-defined]
    for parent, child in itertools.pairwise(names):
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])


def installed() -> bool:
    return bool(getattr(sys.modules.get(FRAMING_MODULE), "STANDS_IN", False))
