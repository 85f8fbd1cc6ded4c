"""No PATH: the daemons' ledgers on this host (``layout_ledger.store.locations``).

Every command that takes ledgers takes none to mean the ledgers the daemons of this user write
by: ``SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE`` when set (as the daemons were given it), else the
default location (/var/lib for root, else the XDG state home). The command says on stderr which
template it read and why; a command that reads one ledger needs the template to match exactly
one. Filled in before the verb runs, so each verb sees a PATH as if it had been typed.
"""

from __future__ import annotations

import argparse

from layout_ledger.cli.output import print_note
from layout_ledger.cli.parser import PROG, VERB_OPTIONS
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.core.errors import LedgerFileError
from layout_ledger.store import locations

# The shared option that holds a verb's ledgers: its attribute, and whether it takes many.
_HOLDERS = {
    "ledger": ("ledger", False),
    "ledgers": ("ledger", True),
    "timeline": ("ledger", True),
    "paths": ("paths", True),
}


def _holder(verb: str) -> tuple[str, bool]:
    if verb == "diff":  # [LEDGER] V1 V2 (parser._diff_operands)
        return "ledger", False
    if verb in ("cordon", "uncordon", "heal"):
        return "targets", True
    shared, _ = VERB_OPTIONS[verb]
    (option,) = (option for option in shared if option in _HOLDERS)
    return _HOLDERS[option]


def fill_default_ledgers(args: argparse.Namespace) -> None:
    """Give ``args`` the daemons' ledgers on this host when the command line named none."""
    attribute, many = _holder(args.command)
    given = getattr(args, attribute, None)
    if given:
        return
    where = locations.ledgers_on_this_host()
    advice = (
        f"name the ledgers (`{PROG} {args.command} PATH`), or set {locations.TEMPLATE_ENV} to "
        f"the template the daemons were given (--expert-layout-ledger)"
    )
    try:
        found = expand_ledger_paths([where.template])
    except LedgerFileError:
        raise LedgerFileError(
            f"no PATH given, and no ledger matches the daemons' ledger template on this host, "
            f"{where.template} ({where.source}): {advice}"
        ) from None
    print_note(
        args.command, f"the daemons' ledgers on this host: {where.template} ({where.source})"
    )
    if many:
        setattr(args, attribute, [where.template])
    elif len(found) == 1:
        setattr(args, attribute, str(found[0]))
    else:
        listed = ", ".join(str(path) for path in found[:3]) + (", ..." if len(found) > 3 else "")
        raise LedgerFileError(
            f"no PATH given, and the daemons' ledger template on this host, {where.template}, "
            f"matches {len(found)} ledgers ({listed}); {args.command} reads one: name it "
            f"(`{PROG} {args.command} PATH`)"
        )
