"""A ledger's retirement: its GPU replaced for good, so the whole-engine tools stop counting it.

``layout-ledger retire`` writes a note beside the ledger (``<ledger>.retired``, JSON, mode 0600,
replaced atomically), never the ledger itself: a retired ledger is evidence, left as it was.
The note names the incarnation it retires and keeps every retire and unretire (who, when, why),
so a retirement is recorded and can be undone (``layout-ledger unretire``), the undo recorded
too. It applies while that incarnation is the ledger's latest: a daemon that starts on the
ledger again (a new incarnation) ends it by itself. ``fleet``, ``metrics`` and ``status`` read it
(``read_retirement``).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_ledger.core.errors import LedgerFileError

SUFFIX = ".retired"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def note_path(ledger: str | os.PathLike[str]) -> Path:
    """The retirement note beside the ledger file (a symbolic link resolved)."""
    real = Path(os.path.realpath(ledger))
    return real.with_name(real.name + SUFFIX)


@dataclass(frozen=True)
class RetirementStep:
    """One retire or unretire: what, when, by whom, why, and the incarnation it named."""

    action: str  # "retire" or "unretire"
    at: str
    by: str
    reason: str
    incarnation_id: int

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "at": self.at,
            "by": self.by,
            "reason": self.reason,
            "incarnation_id": self.incarnation_id,
        }


@dataclass(frozen=True)
class Retirement:
    """A ledger's retirement note: its steps, oldest first; the last one says the state."""

    steps: tuple[RetirementStep, ...]

    @property
    def last(self) -> RetirementStep | None:
        return self.steps[-1] if self.steps else None

    def applies_to(self, incarnation_id: int) -> bool:
        """Retired now: the last step retires exactly this (the latest) incarnation."""
        last = self.last
        return (
            last is not None and last.action == "retire" and last.incarnation_id == incarnation_id
        )

    def to_json(self) -> dict[str, Any]:
        return {"steps": [step.to_json() for step in self.steps]}


def read_retirement(ledger: str | os.PathLike[str]) -> Retirement | None:
    """The ledger's retirement note, None when it has none; a note that is a link, is not the
    ledger owner's or may be written by others is refused (``LedgerFileError``), as the ledger's
    other companions are."""
    path = note_path(ledger)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerFileError(f"cannot read the retirement note {path}: {exc.strerror}") from exc
    owner = os.stat(os.path.realpath(ledger)).st_uid
    if not stat.S_ISREG(info.st_mode) or info.st_uid != owner or info.st_mode & _OTHERS_WRITE:
        raise LedgerFileError(
            f"the retirement note {path} is not a regular file of the ledger's owner that only "
            f"they may write; remove it (or `layout-ledger unretire`) and retry"
        )
    try:
        with open(path, "rb") as note:
            raw = json.loads(note.read(1 << 20))
        steps = tuple(
            RetirementStep(
                action=str(step["action"]),
                at=str(step["at"]),
                by=str(step["by"]),
                reason=str(step["reason"]),
                incarnation_id=int(step["incarnation_id"]),
            )
            for step in raw["steps"]
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LedgerFileError(
            f"the retirement note {path} cannot be read ({type(exc).__name__}: {exc}); remove "
            f"it, or run `layout-ledger unretire` to rewrite it"
        ) from exc
    if any(step.action not in ("retire", "unretire") for step in steps):
        raise LedgerFileError(f"the retirement note {path} holds an unknown action")
    return Retirement(steps)


def current_retirement(
    ledger: str | os.PathLike[str], incarnation_id: int
) -> RetirementStep | None:
    """The retire step in force for the ledger's latest incarnation, or None."""
    note = read_retirement(ledger)
    if note is None or not note.applies_to(incarnation_id):
        return None
    return note.last
