"""Where a daemon incarnation ran: host, device, ranks, process, socket and software versions.

A daemon records its ``IncarnationOrigin`` when it starts an incarnation (schema revision
``0004_incarnation_origin``): the questions an operator asks of many ledgers at once ("which
rank is this file, on which host, is its daemon still running?") need it, and the daemon is the
only one that knows. Every field may be unknown (``None``): a ledger written before 0004 has
none of them, and a daemon records only what it knows (the model-less test daemon has no GPU).
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# The distribution whose version an incarnation records as ``plugin_version``.
DISTRIBUTION = "sglang-expert-layout-ledger"


@dataclass(frozen=True)
class IncarnationOrigin:
    """Where one daemon incarnation ran; ``None`` where it was not recorded."""

    host: str | None = None
    device_uuid: str | None = None
    gpu_id: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    ep_rank: int | None = None
    pid: int | None = None
    socket_path: str | None = None
    sglang_version: str | None = None
    plugin_version: str | None = None

    @classmethod
    def of_this_process(cls, **known: Any) -> IncarnationOrigin:
        """This process's host, pid and installed versions, plus what the caller knows."""
        here: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "sglang_version": installed_version("sglang"),
            "plugin_version": installed_version(DISTRIBUTION) or _package_version(),
        }
        here.update(known)
        return cls(**here)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> IncarnationOrigin:
        """The origin columns of an ``incarnations`` row (text and integers as stored)."""
        values: dict[str, Any] = {}
        for name in COLUMNS:
            value = row.get(name)
            if name in INTEGER_COLUMNS:
                values[name] = value if type(value) is int else None
            else:
                values[name] = None if value is None else str(value)
        return cls(**values)

    def to_row(self) -> tuple[Any, ...]:
        """The column values, in ``COLUMNS`` order."""
        return tuple(getattr(self, name) for name in COLUMNS)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS}

    @property
    def recorded(self) -> bool:
        return any(value is not None for value in self.to_row())


# The ``incarnations`` columns that hold an origin (revision 0004), in the dataclass's order.
COLUMNS: tuple[str, ...] = tuple(field.name for field in fields(IncarnationOrigin))
INTEGER_COLUMNS = frozenset({"gpu_id", "tp_rank", "pp_rank", "ep_rank", "pid"})


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``; None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_version() -> str:
    import layout_ledger

    return layout_ledger.__version__
