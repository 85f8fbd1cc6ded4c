"""How strictly daemons and engines check slot content: ``enforce`` (default), ``warn``, ``off``.

One setting for both sides, ``SGLANG_EXPERT_LAYOUT_CONTENT_CHECK`` (the daemon launcher's
``--expert-layout-content-check`` sets it, so the daemons it spawns see it, as the ledger
settings travel; ``ledger_paths``):

- ``enforce``: a daemon fingerprints its slots at load and at every commit; a load whose replicas
  differ makes it dirty (it refuses ``fetch_state`` and begin). An engine checks at startup that
  every slot holds the expert its map names, fails on every rank when one does not, and repairs
  daemons that an engine left mid-move.
- ``warn``: the same fingerprints and checks, but the two checks of a load only log what they
  find: a daemon whose replicas differ stays clean, an engine whose loaded slots do not hold
  their experts starts. Repairs still happen, and what a commit or an explicit content check
  finds still marks the daemon dirty (the record would otherwise name content it does not have).
- ``off``: no fingerprint is computed or recorded; a daemon answers the content check
  ``no_record``, and an engine starts as it did before content checks existed.
"""

from __future__ import annotations

import enum
import os

CONTENT_CHECK_ENV = "SGLANG_EXPERT_LAYOUT_CONTENT_CHECK"


class ContentCheck(enum.Enum):
    ENFORCE = "enforce"
    WARN = "warn"
    OFF = "off"


CHOICES = tuple(mode.value for mode in ContentCheck)


class ContentSettingError(ValueError):
    """A content check setting that is not one of ``CHOICES``."""


def parse_content_check(raw: str) -> ContentCheck:
    try:
        return ContentCheck(raw.strip().lower())
    except ValueError:
        raise ContentSettingError(
            f"{CONTENT_CHECK_ENV}={raw!r} is not one of {', '.join(CHOICES)}"
        ) from None


def content_check() -> ContentCheck:
    """The mode in force: the environment (set by the launcher's flag), else ``enforce``."""
    raw = os.environ.get(CONTENT_CHECK_ENV)
    if raw is None or raw.strip() == "":
        return ContentCheck.ENFORCE
    return parse_content_check(raw)


def export_content_check(mode: str | None) -> None:
    """Hand the launcher's flag to this process and every daemon it spawns (None: unchanged)."""
    if mode is not None:
        os.environ[CONTENT_CHECK_ENV] = parse_content_check(mode).value
