"""What identifies the weights a daemon loads, recorded with each incarnation (a restore needs
the same).

``checkpoint_digest`` is SHA-256 over the checkpoint's ``config.json`` and its weight index
(``*.index.json``; without one, the names and sizes of its weight files), and the load settings
that change the loaded bytes (dtype, quantization, revision). It reads a few small files, never
a weight: the bytes themselves are checked after the load, slot by slot, against the
fingerprints the ledger recorded (``restore.check_restored_content``). So a checkpoint whose
weights changed under the same config and index restores the layout, and its load check names
every slot that differs. A model path that is not a local directory (a hub id) is identified by
its name and revision.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    """The identity of the checkpoint at ``model_path`` loaded with these settings."""
    load = {"dtype": str(dtype), "quantization": str(quantization), "revision": str(revision)}
    directory = Path(model_path)
    if not directory.is_dir():
        return _digest({"model": os.fspath(model_path), "load": load})
    files = sorted(entry for entry in directory.iterdir() if entry.is_file())
    indexes = [entry for entry in files if entry.name.endswith(INDEX_SUFFIX)]
    identity: dict[str, Any] = {
        "config": _file_digest(directory / CONFIG_FILE),
        "indexes": {entry.name: _file_digest(entry) for entry in indexes},
        "load": load,
    }
    if not indexes:
        identity["weights"] = [
            [entry.name, entry.stat().st_size]
            for entry in files
            if entry.name.endswith(WEIGHT_SUFFIXES)
        ]
    return _digest(identity)


def _file_digest(path: Path) -> str | None:
    """SHA-256 of a small file's bytes (None: absent; its size when too large to read)."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > MAX_IDENTITY_FILE:
        return f"size {size}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
