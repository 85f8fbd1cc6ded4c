"""Every flag and environment variable of the daemon and the engine, one row each.

Each row (``Setting``) names its environment variable, the daemon launcher's flag (none for
what only an engine reads), its default, its parser and the error a bad value gets. The rows are
the settings tables of docs/settings.md and docs/daemon.md; tests/test_settings_docs.py keeps
them equal. The defaults and their reasons come first, in one block.

The settings travel in the environment on purpose: an engine in ``--weight-cache-mode daemon``
and sglang's standalone launcher start each daemon with ``multiprocessing`` spawn, and a spawned
child inherits the environment but none of the parent's parsed flags. So the launcher's flags
are written to the environment (``export_daemon_flags``) and every reader reads that. A variable
that is unset, empty or only blanks means the default.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from layout_ledger.store import locations


class ContentCheck(enum.Enum):
    """How strictly daemons and engines check slot content (one setting for both sides).

    - ``enforce``: a daemon fingerprints its slots at load and at every commit; a load whose
      replicas differ makes it dirty (it refuses ``fetch_state`` and begin). An engine checks at
      startup that every slot holds the expert its map names, fails on every rank when one does
      not, and repairs daemons that an engine left mid-move.
    - ``warn``: the same fingerprints and checks, but the two checks of a load only log what they
      find: a daemon whose replicas differ stays clean, an engine whose loaded slots do not hold
      their experts starts. Repairs still happen, and what a commit or an explicit content check
      finds still marks the daemon dirty (the record would otherwise name content it does not
      have).
    - ``off``: no fingerprint is computed or recorded; a daemon answers the content check
      ``no_record``, and an engine starts as it did before content checks existed.
    """

    ENFORCE = "enforce"
    WARN = "warn"
    OFF = "off"


CHOICES = tuple(mode.value for mode in ContentCheck)


class RestoreMode(enum.Enum):
    """Which layout a daemon with ``--enable-eplb`` loads its weights into.

    - ``last``: the newest committed version of its ledger's earlier incarnations, when it was
      recorded for the same geometry and checkpoint and its rows verify, agreed with the other
      daemons of its engine; it starts at that version's number and digest. Otherwise (and
      with ``initial``) sglang's initial layout at version 0, with one warning naming why.
    - ``initial``: always sglang's initial layout at version 0 (the behaviour before restores).
    """

    LAST = "last"
    INITIAL = "initial"


RESTORE_CHOICES = tuple(mode.value for mode in RestoreMode)


class HealMode(enum.Enum):
    """Whether a dirty daemon reloads its dirty layers' slots from its checkpoint by itself.

    - ``auto``: when no live engine can be routing with the slots it rewrites (the mover is
      gone, no other engine holds a lease; for a content mark, no non-following fetch), it
      heals by itself; otherwise it waits for ``layout-ledger heal`` and says so.
    - ``off``: only when asked (``expert_layout_heal``, ``layout-ledger heal``).
    """

    AUTO = "auto"
    OFF = "off"


HEAL_CHOICES = tuple(mode.value for mode in HealMode)

# --- Defaults, and why -----------------------------------------------------------------------

# The ledgers live where daemons keep state that survives a reboot (a restore reads them at the
# next start): /var/lib/sglang/expert_layouts/ for a root daemon, else
# $XDG_STATE_HOME/sglang/expert_layouts/ (~/.local/state when unset), one file per daemon, i.e.
# per GPU, keyed by the device UUID as sglang's socket is; never /tmp (tmp cleaners, PrivateTmp=,
# a reboot). That directory is private (0700, created when missing, refused when someone else's
# or loosened). The rule is layout_ledger.store.locations' (the CLI, which cannot import this
# plugin, reads the same default when given no PATH); this is its row.
DEFAULT_LEDGER_TEMPLATE = locations.default_ledger_template()  # this process's user's
PLACEHOLDER = locations.PLACEHOLDER

# Rows of the last 1000 versions per incarnation: at one all-layer rebalance a minute, about 17
# hours of full history (the current map and every event are kept whatever the setting; the
# docs/benchmarks.md gives the file's size over a week).
DEFAULT_KEEP_VERSIONS = 1000

# Retention runs every 100 commits, off the request path: the rows it checks and drops per run
# stay small, and the file holds at most 100 versions more than it keeps.
DEFAULT_PRUNE_EVERY = 100

# Seconds a client has for its whole request (from the accept) and, separately, for taking its
# reply. An engine's exchange is a few kilobytes over a local socket and takes milliseconds; a
# client that takes longer holds one of the daemon's connection threads until then.
DEFAULT_REQUEST_TIMEOUT = 5.0

# Seconds a starting rank waits for another engine's pending move to end before the engine
# fails with the reason: far longer than a healthy move of a chunk takes, short enough that a
# move left by an engine that hangs fails the start instead of hanging it.
DEFAULT_WAIT_TIMEOUT = 300.0

# Wrong content routes tokens to the wrong expert without any error: refuse it by default.
DEFAULT_CONTENT_CHECK = ContentCheck.ENFORCE

# A restarted daemon keeps the balance EPLB learned: it loads its weights into the last committed
# layout instead of the initial one (engines then run balanced at once, with no rebalance to
# gather statistics for), and a version number keeps naming one map.
DEFAULT_RESTORE = RestoreMode.LAST

# A dirty daemon is back in seconds, reading only its dirty layers' experts, instead of a
# restart that reads the whole checkpoint and makes every engine fetch again.
DEFAULT_HEAL = HealMode.AUTO

# Seconds one checkpoint read of a heal or reload may take (the index, then each layer's local
# experts, each in a child process, checkpoint_reads.py) before the child is killed and the heal
# fails naming the file: a blocked file (a FIFO, a stalled NFS/FUSE mount) never holds a daemon.
# Sized for the largest read it makes: one layer of DeepSeek-V3 at EP 16 from a slow disk. A rank
# holds 288 / 16 = 18 slots, at most 18 distinct experts of 3 x 7168 x 2048 FP8 bytes plus their
# 128 x 128-block float32 scales (10,752 B): 18 x 44,050,944 B = 793 MB; at 10 MB/s (a degraded
# network mount; a local disk streams 10 to 100 times faster) that is 79 s, so 120 s with room.
DEFAULT_HEAL_TIMEOUT = 120.0

# An engine attaches as an active engine (it serves and may move experts, as every engine before
# roles did) unless it is started as a warm standby.
ROLE_ACTIVE = "active"
ROLE_STANDBY = "standby"
ROLE_CHOICES = (ROLE_ACTIVE, ROLE_STANDBY)
DEFAULT_ROLE = ROLE_ACTIVE

# Seconds without a forward pass after which a standby releases its lease: long enough that a
# standby serving a steady trickle keeps it (no lease round trip per batch), short enough that a
# standby that served only sglang's warmup request stops pausing the mover's rebalancing soon.
DEFAULT_STANDBY_IDLE = 30.0

# --- The rows ----------------------------------------------------------------------------------

T = TypeVar("T")


class SettingError(ValueError):
    """A flag or environment variable whose value cannot be used."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One row of the settings table: where the value comes from and how it is read."""

    env: str
    flag: str | None  # the daemon launcher's flag; None: only the environment (engine)
    default: T
    parse: Callable[[str, str], T]  # (text, the variable or flag it came from) -> value
    help: str  # what it sets, as the launcher's --help says it
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # The default as the docs write it, when it depends on who runs the process.
    documented_default: str | None = None

    @property
    def default_text(self) -> str:
        """The default as the docs' tables and --help write it."""
        return self.documented_default or _text(self.default)

    def configured(self) -> T | None:
        """The environment's value, or None when the variable is unset or blank."""
        raw = os.environ.get(self.env)
        if raw is None or not raw.strip():
            return None
        return self.parse(raw, self.env)

    def read(self) -> T:
        """The value in force: the environment's (set by the launcher's flag), else the default."""
        value = self.configured()
        return self.default if value is None else value

    def export(self, raw: str | None, name: str | None = None) -> None:
        """Check a flag's value and hand it to this process and every daemon it spawns.

        ``raw`` None (the flag not given) leaves the environment as it is; ``name`` is what an
        error calls the value (the flag by default).
        """
        if raw is None:
            return
        value = self.parse(raw, name or self.flag or self.env)
        os.environ[self.env] = repr(value) if isinstance(value, float) else _text(value)


def _text(value: object) -> str:
    """A value as people read it (a float without trailing zeros, an enum by its value)."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# --- Parsers: text -> value, or SettingError naming where the text came from -------------------


def check_ledger_template(template: str, name: str = "") -> str:
    """A ledger template with ``{device_uuid}`` and no other placeholder (the message names the
    variable and the flag both, whichever ``name`` it came from)."""
    if PLACEHOLDER not in template:
        raise SettingError(
            f"the expert layout ledger template {template!r} must contain '{PLACEHOLDER}': each "
            f"daemon (one per GPU) needs its own ledger file, and a second daemon on one file "
            f"cannot start (set {LEDGER_TEMPLATE.env} or {LEDGER_TEMPLATE.flag})"
        )
    try:
        template.format(device_uuid="GPU")
    except (KeyError, IndexError, ValueError) as exc:
        raise SettingError(
            f"the expert layout ledger template {template!r} has a placeholder other than "
            f"'{PLACEHOLDER}' ({exc!r}); use only '{PLACEHOLDER}'"
        ) from exc
    return template


def positive_int(raw: str, name: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SettingError(f"{name}={raw!r} must be a positive integer")
    return value


def positive_seconds(raw: str, name: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SettingError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def seconds_from_zero(raw: str, name: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise SettingError(f"{name}={raw!r} is not a finite number of seconds >= 0")
    return value


def engine_role(raw: str, name: str) -> str:
    role = raw.strip().lower()
    if role not in ROLE_CHOICES:
        raise SettingError(f"{name}={raw!r} is not one of {', '.join(ROLE_CHOICES)}")
    return role


E = TypeVar("E", bound=enum.Enum)


def one_of(enum_type: type[E]) -> Callable[[str, str], E]:
    """The parser of a setting whose values are ``enum_type``'s (case and blanks ignored)."""
    choices = ", ".join(str(member.value) for member in enum_type)

    def parse(raw: str, name: str) -> E:
        try:
            return enum_type(raw.strip().lower())
        except ValueError:
            raise SettingError(f"{name}={raw!r} is not one of {choices}") from None

    return parse


content_check_mode = one_of(ContentCheck)
restore_mode = one_of(RestoreMode)


LEDGER_TEMPLATE: Setting[str] = Setting(
    env=locations.TEMPLATE_ENV,
    flag="--expert-layout-ledger",
    default=DEFAULT_LEDGER_TEMPLATE,
    parse=check_ledger_template,
    help="path template of the expert layout ledgers, with {device_uuid} (one ledger per GPU); "
    "the default's directory is private (0700) and survives a reboot",
    metavar="TEMPLATE",
    documented_default=locations.DEFAULT_TEXT,
)
KEEP_VERSIONS: Setting[int] = Setting(
    env="SGLANG_EXPERT_LAYOUT_KEEP_VERSIONS",
    flag="--expert-layout-keep-versions",
    default=DEFAULT_KEEP_VERSIONS,
    parse=positive_int,
    help="keep the layout rows of the last N versions",
    metavar="N",
)
PRUNE_EVERY: Setting[int] = Setting(
    env="SGLANG_EXPERT_LAYOUT_PRUNE_EVERY",
    flag="--expert-layout-prune-every",
    default=DEFAULT_PRUNE_EVERY,
    parse=positive_int,
    help="prune the ledger every N commits",
    metavar="N",
)
REQUEST_TIMEOUT: Setting[float] = Setting(
    env="SGLANG_EXPERT_LAYOUT_REQUEST_TIMEOUT",
    flag="--expert-layout-request-timeout",
    default=DEFAULT_REQUEST_TIMEOUT,
    parse=positive_seconds,
    help="seconds a client has to send its whole request (from the accept), and again to take "
    "its reply, before the daemon drops the connection",
    metavar="SECONDS",
)
WAIT_TIMEOUT: Setting[float] = Setting(
    env="SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT",
    flag=None,
    default=DEFAULT_WAIT_TIMEOUT,
    parse=seconds_from_zero,
    help="seconds an engine rank waits at startup for another engine's pending move to end",
)
CONTENT_CHECK: Setting[ContentCheck] = Setting(
    env="SGLANG_EXPERT_LAYOUT_CONTENT_CHECK",
    flag="--expert-layout-content-check",
    default=DEFAULT_CONTENT_CHECK,
    parse=content_check_mode,
    help="fingerprint the expert slots at load and at each commit, and refuse to serve a load "
    "whose replicas differ (enforce), only log it (warn), or record no fingerprints (off)",
    choices=CHOICES,
)
RESTORE: Setting[RestoreMode] = Setting(
    env="SGLANG_EXPERT_LAYOUT_RESTORE",
    flag="--expert-layout-restore",
    default=DEFAULT_RESTORE,
    parse=restore_mode,
    help="load the weights into the newest committed layout of the ledger's earlier "
    "incarnations, agreed by the engine's daemons (last), or into sglang's initial layout "
    "at version 0 (initial)",
    choices=RESTORE_CHOICES,
)
HEAL: Setting[HealMode] = Setting(
    env="SGLANG_EXPERT_LAYOUT_HEAL",
    flag="--expert-layout-heal",
    default=DEFAULT_HEAL,
    parse=one_of(HealMode),
    help="a dirty daemon reloads its dirty layers' slots from its checkpoint by itself when no "
    "live engine can be routing with them (auto), or only when asked by `layout-ledger heal` "
    "(off)",
    choices=HEAL_CHOICES,
)
HEAL_TIMEOUT: Setting[float] = Setting(
    env="SGLANG_EXPERT_LAYOUT_HEAL_TIMEOUT",
    flag="--expert-layout-heal-timeout",
    default=DEFAULT_HEAL_TIMEOUT,
    parse=positive_seconds,
    help="seconds one checkpoint read of a heal or reload (the index, then each layer's local "
    "experts, in a child process) may take before it is killed and the heal fails naming the file",
)

ROLE: Setting[str] = Setting(
    env="SGLANG_EXPERT_LAYOUT_ROLE",
    flag=None,
    default=DEFAULT_ROLE,
    parse=engine_role,
    help="the engine's role on its daemons: active (serves, may move experts) or standby (holds "
    "no lease until it serves, so the active engine keeps rebalancing)",
    choices=ROLE_CHOICES,
)
STANDBY_IDLE: Setting[float] = Setting(
    env="SGLANG_EXPERT_LAYOUT_STANDBY_IDLE",
    flag=None,
    default=DEFAULT_STANDBY_IDLE,
    parse=positive_seconds,
    help="seconds without a forward pass after which a standby releases its lease",
)

# Every row, in the docs tables' order.
SETTINGS: tuple[Setting[Any], ...] = (
    LEDGER_TEMPLATE,
    KEEP_VERSIONS,
    PRUNE_EVERY,
    REQUEST_TIMEOUT,
    WAIT_TIMEOUT,
    CONTENT_CHECK,
    RESTORE,
    HEAL,
    HEAL_TIMEOUT,
    ROLE,
    STANDBY_IDLE,
)
# (flag, row) of every row the daemon launcher has a flag for.
DAEMON_FLAGS = tuple((setting.flag, setting) for setting in SETTINGS if setting.flag is not None)


def content_check() -> ContentCheck:
    """The content check in force (daemons and engines)."""
    return CONTENT_CHECK.read()


# --- The daemon launcher's flags -------------------------------------------------------------


def add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher's ``--expert-layout-*`` flags, one per row that has one."""
    for flag, setting in DAEMON_FLAGS:
        add_setting_flag(parser, flag, setting)


def add_setting_flag(parser: Any, flag: str, setting: Setting[Any]) -> None:
    """One row's flag on ``parser`` (or an argument group): its value stays text, unparsed."""
    parser.add_argument(
        flag,
        default=None,
        metavar=setting.metavar,
        choices=setting.choices,
        help=f"{setting.help} (env {setting.env}; default {setting.default_text})",
    )


def export_daemon_flags(args: argparse.Namespace) -> None:
    """Hand the flags given to this process and every daemon it spawns; raise ``SettingError``
    (before anything starts) for a bad one."""
    for flag, setting in DAEMON_FLAGS:
        setting.export(getattr(args, _dest(flag)))


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
