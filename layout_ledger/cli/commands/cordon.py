"""``layout-ledger cordon`` and ``uncordon``: ask daemons to answer every begin ``busy``, or stop.

The CLI's one write, a request over each daemon's control socket (``cli.daemon_socket``; the
ledger is never written by the CLI): a SOCKET is the daemon's control socket, a PATH names
ledgers as ``fleet`` takes them, whose latest incarnation recorded its daemon's socket. The
daemon records the cordon as an event (``status``, ``fleet`` and ``metrics`` show it); engines
that try to move experts meanwhile pause and retry, as they do beside a second engine. A daemon
restart clears a cordon. Exit 0 when every daemon did it (or keeps no record, so no move can
begin there), 6 when a daemon does not run, 1 when one refused or could not be reached.
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.cli import exit_codes
from layout_ledger.cli.daemon_socket import ask, unsuccessful_result
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.core.rules import MAX_CORDON_REASON
from layout_ledger.history.liveness import daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.rows import incarnation
from layout_ledger.wire.protocol import (
    CordonRequest,
    CordonView,
    Outcome,
    UncordonRequest,
)


def run(args: argparse.Namespace) -> int:
    reason = cordon_reason(args.reason)
    report = send_to_daemons(args.targets, CordonRequest(reason))
    emit(args, report.to_json(), render_cordon(report))
    return report.exit_code


def run_uncordon(args: argparse.Namespace) -> int:
    report = send_to_daemons(args.targets, UncordonRequest())
    emit(args, report.to_json(), render_cordon(report))
    return report.exit_code


def cordon_reason(given: str | None) -> str:
    """What the daemon records: the operator's words and who gave them (user and host)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    who = f"by {user} on {socket.gethostname()}"
    said = " ".join((given or "no reason given").split())
    room = MAX_CORDON_REASON - len(who) - 2
    if len(said) > room:
        said = said[: room - 3] + "..."
    return f"{said}; {who}" if said.isprintable() else who


@dataclass(frozen=True)
class Target:
    """One daemon to ask: its socket, the ledger that named it, or why it cannot be asked."""

    socket_path: str | None
    ledger: str | None
    not_running: str | None = None  # why no daemon runs there (its ledger says so)


def daemon_targets(specs: Sequence[str]) -> list[Target]:
    """A SOCKET is itself; a PATH's ledgers give their daemons' recorded sockets."""
    found: list[Target] = []
    for spec in specs:
        try:
            node = os.stat(spec)
        except OSError:
            node = None
        if node is not None and stat.S_ISSOCK(node.st_mode):
            found.append(Target(spec, None))
            continue
        for path in expand_ledger_paths([spec]):
            with LedgerReader(path) as reader, reader.connect() as conn:
                inc = incarnation(conn)
            liveness = daemon_liveness(path, inc, latest=True)
            socket_path = inc.origin.socket_path
            if liveness.alive is False:
                found.append(Target(socket_path, str(path), not_running=liveness.detail))
            elif socket_path is None:
                found.append(
                    Target(
                        None,
                        str(path),
                        not_running="its daemon recorded no socket (a daemon "
                        "from before schema 0004): name the daemon's socket instead",
                    )
                )
            else:
                found.append(Target(socket_path, str(path)))
    return found


@dataclass(frozen=True)
class DaemonAnswer(JsonShaped):
    """What one daemon answered: ``result`` one of ``cordoned``, ``uncordoned``, ``no_record``,
    ``not_running``, ``refused``, ``unreachable``, ``older_daemon``, ``error``."""

    socket_path: str | None
    ledger: str | None
    result: str
    cordoned: bool | None
    since: str | None
    reason: str | None
    detail: str | None


# The results that mean the request was not carried out (exit 1).
FAILED_RESULTS = frozenset({"refused", "unreachable", "older_daemon", "error"})


@dataclass(frozen=True)
class CordonReport(JsonShaped):
    request: str  # "cordon" or "uncordon"
    daemons: tuple[DaemonAnswer, ...]

    @property
    def exit_code(self) -> int:
        results = {answer.result for answer in self.daemons}
        if results & FAILED_RESULTS:
            return exit_codes.FAILED
        if "not_running" in results:
            return exit_codes.NOT_RUNNING
        return exit_codes.OK


def send_to_daemons(specs: Sequence[str], request: CordonRequest | UncordonRequest) -> CordonReport:
    """Resolve every target first (a PATH that names no ledger fails before any request), then
    ask each daemon in turn."""
    verb = "cordon" if isinstance(request, CordonRequest) else "uncordon"
    answers = []
    for target in daemon_targets(specs):
        answers.append(_ask_one(target, request, verb))
    return CordonReport(verb, tuple(answers))


def _ask_one(target: Target, request: CordonRequest | UncordonRequest, verb: str) -> DaemonAnswer:
    def answer(
        result: str, view: CordonView | None = None, detail: str | None = None
    ) -> DaemonAnswer:
        return DaemonAnswer(
            socket_path=target.socket_path,
            ledger=target.ledger,
            result=result,
            cordoned=None if view is None else view.cordoned,
            since=None if view is None else view.since,
            reason=None if view is None else view.reason,
            detail=detail,
        )

    if target.not_running is not None or target.socket_path is None:
        return answer("not_running", detail=target.not_running)
    reply = ask(target.socket_path, request)
    if reply.outcome is Outcome.OK:
        view = CordonView.from_wire(reply.body.get("cordon"))
        return answer("cordoned" if verb == "cordon" else "uncordoned", view)
    return answer(unsuccessful_result(reply), detail=reply.reason)


def render_cordon(report: CordonReport) -> list[str]:
    return [_line(report.request, answer) for answer in report.daemons]


def _line(verb: str, answer: DaemonAnswer) -> str:
    where = answer.socket_path or "-"
    if answer.ledger is not None:
        where = f"{answer.ledger} (socket {where})"
    if answer.result == "cordoned":
        return (
            f"{where}: cordoned since {answer.since} ({answer.reason}): every begin is answered "
            f"busy until `layout-ledger uncordon`; a daemon restart clears it"
        )
    if answer.result == "uncordoned":
        return f"{where}: not cordoned: moves may begin again"
    if answer.result == "no_record":
        return f"{where}: keeps no expert layout record, so no move begins there; nothing to {verb}"
    if answer.result == "not_running":
        why = answer.detail or "no daemon listens on its socket"
        return f"{where}: not running ({why}); a daemon started now starts uncordoned"
    if answer.result == "older_daemon":
        return (
            f"{where}: this daemon does not know {verb} (sglang's own daemon, or this plugin from "
            f"before cordons): {answer.detail}"
        )
    return f"{where}: {answer.result}: {answer.detail}"
