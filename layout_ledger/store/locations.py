"""Where the daemons' ledgers live on a host: the one default, chosen here, for both sides.

A ledger must outlive its daemon (a restart, and a restore, read it at the next start) and the
host's reboots, so it lives where daemons keep state that persists, never under ``/tmp`` (tmp
cleaners, systemd's ``PrivateTmp=``, a tmpfs emptied at boot). As other daemons do: a daemon
running as root keeps its ledgers under ``/var/lib`` (the FHS's variable state of system
services); any other user's under ``$XDG_STATE_HOME`` (the XDG base directory for state that
should persist between restarts; ``~/.local/state`` when it is unset or not absolute, as the
specification says). One file per daemon, i.e. per GPU, keyed by the device UUID as sglang's
daemon socket is::

    /var/lib/sglang/expert_layouts/expert_layout_{device_uuid}.sqlite              (root)
    $XDG_STATE_HOME/sglang/expert_layouts/expert_layout_{device_uuid}.sqlite       (any other user)

The ``expert_layouts`` directory is private (0700, the daemon's user's: the daemon creates it,
with any missing parent 0700, and refuses one that is someone else's or loosened).
``SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE`` (which the daemon launcher's ``--expert-layout-ledger``
sets for its daemons) replaces the default on both sides: the daemons write there, and
``layout-ledger`` given no PATH reads there. sglang_integration/settings.py's ledger row is this
default; the CLI cannot import the plugin, so the rule lives here, once, for both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TEMPLATE_ENV = "SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"
PLACEHOLDER = "{device_uuid}"

SYSTEM_STATE_HOME = "/var/lib"  # a root daemon's
STATE_HOME_ENV = "XDG_STATE_HOME"  # any other user's; ~/.local/state when unset
LEDGER_DIRECTORY = os.path.join("sglang", "expert_layouts")  # its last part is the private one
LEDGER_FILE = "expert_layout_{device_uuid}.sqlite"

ROOT_DEFAULT = os.path.join(SYSTEM_STATE_HOME, LEDGER_DIRECTORY, LEDGER_FILE)
USER_DEFAULT = os.path.join(f"${STATE_HOME_ENV}", LEDGER_DIRECTORY, LEDGER_FILE)
# The default as the docs and --help write it.
DEFAULT_TEXT = f"{ROOT_DEFAULT} as root, else {USER_DEFAULT} ({STATE_HOME_ENV}: ~/.local/state)"


def state_home(euid: int, environ: Mapping[str, str]) -> str:
    """Where this user's daemons keep state: /var/lib for root, else the XDG state home."""
    if euid == 0:
        return SYSTEM_STATE_HOME
    configured = environ.get(STATE_HOME_ENV, "").strip()
    if os.path.isabs(configured):
        return configured
    home = environ.get("HOME", "").strip() or os.path.expanduser("~")
    return os.path.join(home, ".local", "state")


def effective_uid() -> int:
    """This process's user, whose default is read (one place, so a test can name another)."""
    return os.geteuid()


def default_ledger_template(
    euid: int | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The default template for a process of user ``euid`` (default: this one's)."""
    euid = effective_uid() if euid is None else euid
    environ = os.environ if environ is None else environ
    return os.path.join(state_home(euid, environ), LEDGER_DIRECTORY, LEDGER_FILE)


# What a person who named a path with no ledger can do (the readers' and the CLI's messages).
FIND_LEDGERS = "check the path: `layout-ledger fleet` given no PATH lists the daemons' ledgers here"


@dataclass(frozen=True)
class LedgerLocation:
    """The daemons' ledger template on this host, and where it came from (said to the user)."""

    template: str
    source: str

    @property
    def configured(self) -> bool:
        return self.source == TEMPLATE_ENV


def ledgers_on_this_host(environ: Mapping[str, str] | None = None) -> LedgerLocation:
    """The template the daemons of this user write by: the environment's, else the default."""
    environ = os.environ if environ is None else environ
    configured = environ.get(TEMPLATE_ENV, "").strip()
    if configured:
        return LedgerLocation(configured, TEMPLATE_ENV)
    euid = effective_uid()
    who = "root" if euid == 0 else f"uid {euid}"
    return LedgerLocation(
        default_ledger_template(euid, environ), f"the default for {who}; {TEMPLATE_ENV} unset"
    )
