"""The exit codes of ``layout-ledger``, defined once (docs/cli.md lists them).

Scripts branch on these, so a code never changes meaning. ``status`` and ``fleet`` use 3 and 4
(``fleet`` over many ledgers: a dirty daemon, a pending move); ``verify`` and ``export --check``
use 5 when the ledger is readable but wrong, ``fleet`` when the ledgers disagree; ``status`` and
``fleet`` use 6 when the daemon does not run (systemctl's 3 for "inactive" is taken here by
"dirty", which scripts already branch on, so "not running" gets the next free code);
``fleet --ready-to-stop`` uses 7 when the engine is not ready to stop.
"""

from __future__ import annotations

OK = 0
# The command could not do what was asked: a version that is not held, a prune refused while a
# move is pending, a ledger owned for writing by a running daemon, a bad value for this ledger.
FAILED = 1
# Bad arguments, or a file that is no usable ledger: missing, unreadable, not SQLite, not a
# ledger, a schema newer than this code (or older, for read commands: run `upgrade`), I/O errors.
UNUSABLE = 2
# status, fleet: the layout is unknown (an engine left mid-move); restart the daemon. export:
# refused for that reason.
DIRTY = 3
# status: a move is pending, or the daemon refused requests recently (status.REFUSALS_WINDOW);
# fleet: a move is pending; export: refused for that reason.
PENDING_OR_REFUSALS = 4
# verify found an inconsistency; export --check found sglang's metadata differs from the ledger;
# prune refused a ledger that fails verify (it never deletes evidence); fleet: the ledgers of
# one engine disagree.
INCONSISTENT = 5
# status: the daemon of the ledger's latest incarnation is not running (its writer lock is free:
# killed, or stopped); fleet: no daemon of the ledgers runs; cordon, uncordon: a daemon's socket
# is not there (no daemon listens).
NOT_RUNNING = 6
# fleet --ready-to-stop: the engine is not ready to stop (a rank not cordoned, or the engine
# not attached there); the reasons are printed.
NOT_READY = 7
# Interrupted with Ctrl-C.
INTERRUPTED = 130
