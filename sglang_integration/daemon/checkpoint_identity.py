"""What identifies the weights a daemon loads, recorded with each incarnation.

``checkpoint_digest`` is SHA-256 over the checkpoint's ``config.json`` and weight index
(``*.index.json``), the load settings that change the loaded bytes (dtype, quantization,
revision), and, for every weight file (``*.safetensors``, ``*.bin``, ``*.pt``), its name, size,
inode and the kernel's modification and change times in nanoseconds (``st_mtime_ns``,
``st_ctime_ns``). It reads two small files and ``stat``s each weight file: never a weight byte,
so it costs the same for DeepSeek-V3's 163 shards as for two (docs/design.md "The checkpoint's
identity" says why the stamps suffice: any write to a file, or its replacement, changes its
change time or inode, which no user call can set back). Two checkpoints with different weight
bytes never share it; the same files copied elsewhere get another one (a new inode and change
time), which only costs the copy a new baseline.

``structure_digest`` is what the identity was before it covered the weights (config, index,
load settings; without an index, the weight files' names and sizes): the daemons of one engine
must agree on it before they restore (on several hosts, each host's copy of the checkpoint has
its own stamps), and an incarnation recorded by older code carries it as its identity.

A model path that is not a local directory (a hub id) is identified by its name and revision.
Files are opened without blocking and only when they are regular files: a FIFO in place of the
config is recorded as such, not waited on.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INDEX_SUFFIX = ".index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# Files larger than this are not read for the identity (a config or an index is far smaller).
MAX_IDENTITY_FILE = 64 * 1024 * 1024


def checkpoint_digest(
    model_path: str | os.PathLike[str],
    *,
    dtype: Any = None,
    quantization: Any = None,
    revision: Any = None,
) -> str:
    """The identity of the checkpoint at ``model_path`` (its weights' files included) loaded
    with these settings."""
    load = _load(dtype, quantization, revision)
    directory = Path(model_path)
    if not directory.is_dir():
        return _digest({"model": os.fspath(model_path), "load": load})
    files = _files(directory)
    identity = _structure(directory, files, load)
    identity["weight_files"] = [_stamp(entry) for entry in files if _is_weight(entry)]
    return _digest(identity)


def structure_digest(
    model_path: str | os.PathLike[str],
    *,
    dtype: Any = None,
    quantization: Any = None,
    revision: Any = None,
) -> str:
    """The checkpoint's structure: ``config.json``, the index and the load settings (without an
    index, the weight files' names and sizes); the same on every host holding a copy."""
    load = _load(dtype, quantization, revision)
    directory = Path(model_path)
    if not directory.is_dir():
        return _digest({"model": os.fspath(model_path), "load": load})
    files = _files(directory)
    identity = _structure(directory, files, load)
    if not identity["indexes"]:
        identity["weights"] = [
            [entry.name, entry.stat().st_size] for entry in files if _is_weight(entry)
        ]
    return _digest(identity)


def _structure(directory: Path, files: list[Path], load: dict[str, str]) -> dict[str, Any]:
    """What both identities hold: ``config.json``'s digest, each index's and the load settings
    (the JSON keys are sorted when digested, so more can be added)."""
    return {
        "config": _file_digest(directory / CONFIG_FILE),
        "indexes": {entry.name: _file_digest(entry) for entry in _indexes(files)},
        "load": load,
    }


def _load(dtype: Any, quantization: Any, revision: Any) -> dict[str, str]:
    return {"dtype": str(dtype), "quantization": str(quantization), "revision": str(revision)}


def _files(directory: Path) -> list[Path]:
    return sorted(entry for entry in directory.iterdir() if entry.is_file())


def _indexes(files: list[Path]) -> list[Path]:
    return [entry for entry in files if entry.name.endswith(INDEX_SUFFIX)]


def _is_weight(entry: Path) -> bool:
    return entry.name.endswith(WEIGHT_SUFFIXES)


def _stamp(entry: Path) -> list[Any]:
    """A weight file's name, size, inode and change stamps (through a symlink: its target's,
    as a hub cache's snapshot links to its blobs)."""
    info = entry.stat()
    return [entry.name, info.st_size, info.st_ino, info.st_mtime_ns, info.st_ctime_ns]


def _file_digest(path: Path) -> str | None:
    """SHA-256 of a small regular file's bytes (None: absent; its size when too large to read;
    what it is when it is not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return f"not a regular file (mode {info.st_mode:o})"
        if info.st_size > MAX_IDENTITY_FILE:
            return f"size {info.st_size}"
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return hashlib.sha256(handle.read(MAX_IDENTITY_FILE + 1)).hexdigest()
    finally:
        os.close(fd)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
