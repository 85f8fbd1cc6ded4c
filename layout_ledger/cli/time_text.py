"""Times as an operator types and reads them, and how long ago a recorded time was (``5 min ago``).

What ``--since`` and ``--until`` take (docs/cli.md "Times" says the same): ISO-8601 (no zone =
UTC, a trailing ``Z`` is UTC, a date alone is its midnight), ``HH:MM[:SS]`` (today, UTC),
``today``, ``yesterday``, ``tomorrow`` (midnight UTC), ``now``, ``@SECONDS`` (Unix time), and a
span back from now (``1h``, ``30min``, ``2d``, ``1h 30min``, ``"1 hour ago"``, ``-45s``) or
ahead of it (``+5min``), as journalctl takes them, except that every time is UTC (the ledger's
clock), never the local zone.

Cheap on purpose (the parser imports it): ``re`` and ``datetime`` only. A ledger writes times
as UTC ISO-8601 text with microseconds, so a time in that spelling compares as text.
"""

from __future__ import annotations

import datetime
import re

_UNITS: dict[str, float] = {}
for _names, _seconds in (
    (("s", "sec", "secs", "second", "seconds"), 1),
    (("m", "min", "mins", "minute", "minutes"), 60),
    (("h", "hr", "hrs", "hour", "hours"), 3600),
    (("d", "day", "days"), 86400),
    (("w", "week", "weeks"), 7 * 86400),
):
    for _name in _names:
        _UNITS[_name] = _seconds

_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")
_RELATIVE = re.compile(r"^[-+]?\s*(?:\d+(?:\.\d+)?\s*[a-z]+\s*)+(?:ago)?$")
_CLOCK = re.compile(r"^\d{1,2}:\d{2}(?::\d{2}(?:\.\d{1,6})?)?$")
_EPOCH = re.compile(r"^@\d+(?:\.\d+)?$")
_DAYS = {"yesterday": -1, "today": 0, "tomorrow": 1}

EXAMPLE = "2026-11-29T13:00:00Z, 13:00, today, @1733400000, 1h, 30min, 2d or '1 hour ago'"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def ledger_time(moment: datetime.datetime) -> str:
    """``moment`` spelled as the ledger spells times (UTC, microseconds)."""
    return moment.astimezone(datetime.timezone.utc).isoformat(timespec="microseconds")


def relative_seconds(value: str) -> float | None:
    """How far back a relative time such as ``1h``, ``1h 30min``, ``"2 days ago"`` or ``-30s``
    reaches, in seconds (``+5min``: -300, ahead); None when ``value`` is not one (``now``: 0)."""
    spelled = value.strip().lower()
    if spelled == "now":
        return 0.0
    if not _RELATIVE.match(spelled) or (spelled.startswith("+") and spelled.endswith("ago")):
        return None
    total = 0.0
    for number, unit in _PART.findall(spelled.removesuffix("ago")):
        if unit not in _UNITS:
            return None
        total += float(number) * _UNITS[unit]
    return -total if spelled.startswith("+") else total


def parse_time(value: str, now: datetime.datetime | None = None) -> str:
    """A time as the module docstring lists them, as the ledger spells times (UTC); ValueError
    when it is none of them."""
    moment = now or utc_now()
    back = relative_seconds(value)
    if back is not None:
        return ledger_time(moment - datetime.timedelta(seconds=back))
    spelled = value.strip()
    midnight = moment.astimezone(datetime.timezone.utc).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    if spelled.lower() in _DAYS:
        return ledger_time(midnight + datetime.timedelta(days=_DAYS[spelled.lower()]))
    if _EPOCH.match(spelled):
        try:
            unix = datetime.datetime.fromtimestamp(float(spelled[1:]), datetime.timezone.utc)
        except (OverflowError, OSError) as exc:
            raise ValueError(f"{spelled} is beyond the times a ledger holds") from exc
        return ledger_time(unix)
    if _CLOCK.match(spelled):
        hour, _, rest = spelled.partition(":")
        clock = datetime.time.fromisoformat(f"{int(hour):02d}:{rest}")
        return ledger_time(datetime.datetime.combine(midnight.date(), clock, datetime.timezone.utc))
    if spelled[-1:] in ("Z", "z"):
        spelled = spelled[:-1] + "+00:00"
    moment = datetime.datetime.fromisoformat(spelled)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return ledger_time(moment)


def ago(recorded: str, now: datetime.datetime) -> str:
    """How long before ``now`` the ledger time ``recorded`` was: ``12 s ago``, ``5 min ago``,
    ``3 h 2 min ago``, ``2 d 4 h ago`` (``in 5 s`` for a time ahead of this clock); ``recorded``
    itself when it is no time."""
    try:
        moment = datetime.datetime.fromisoformat(recorded)
    except ValueError:
        return recorded
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    seconds = int((now - moment).total_seconds())
    span = _span(abs(seconds))
    return f"in {span}" if seconds < 0 else f"{span} ago"


def _span(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes} min"
    if seconds < 86400:
        rest = minutes % 60
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    rest = hours % 24
    return f"{days} d {rest} h" if rest else f"{days} d"
