"""``layout-ledger heal``: ask dirty daemons to reload their dirty layers from their checkpoint.

A request over each daemon's control socket (``expert_layout_heal``; the ledger is never written
by the CLI), resolved as ``cordon`` resolves its targets (a SOCKET, or a PATH whose ledgers
recorded their daemons' sockets). For a daemon run with ``--expert-layout-heal off``, or after a
``heal_failed`` once the operator fixed its cause. Exit 0 when every daemon healed, 1 when one
refused (not dirty, heal unavailable, the heal failed) or could not be reached, 6 when one does
not run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.cordon import Target, daemon_targets
from layout_ledger.cli.daemon_socket import ask, unsuccessful_result
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.wire.protocol import HealRequest, Outcome

# Seconds for the heal's reply: it reads the dirty layers' experts from the checkpoint (seconds
# at DeepSeek-V3's size, far less on a CPU model).
HEAL_TIMEOUT = 600.0


def run(args: argparse.Namespace) -> int:
    report = heal_daemons(args.targets)
    emit(args, report.to_json(), render_heal(report))
    return report.exit_code


@dataclass(frozen=True)
class HealAnswer(JsonShaped):
    """What one daemon answered: ``result`` one of ``healed``, ``no_record``, ``not_running``,
    ``refused``, ``unreachable``, ``older_daemon``, ``error``."""

    socket_path: str | None
    ledger: str | None
    result: str
    version: int | None
    digest: str | None
    detail: str | None


_FAILED = frozenset({"refused", "unreachable", "older_daemon", "error", "no_record"})


@dataclass(frozen=True)
class HealReport(JsonShaped):
    request: str
    daemons: tuple[HealAnswer, ...]

    @property
    def exit_code(self) -> int:
        results = {answer.result for answer in self.daemons}
        if results & _FAILED:
            return exit_codes.FAILED
        if "not_running" in results:
            return exit_codes.NOT_RUNNING
        return exit_codes.OK


def heal_daemons(specs: Sequence[str]) -> HealReport:
    """Resolve every target first, then ask each daemon in turn."""
    return HealReport("heal", tuple(_heal_one(target) for target in daemon_targets(specs)))


def _heal_one(target: Target) -> HealAnswer:
    def answer(
        result: str,
        version: int | None = None,
        digest: str | None = None,
        detail: str | None = None,
    ) -> HealAnswer:
        return HealAnswer(target.socket_path, target.ledger, result, version, digest, detail)

    if target.not_running is not None or target.socket_path is None:
        return answer("not_running", detail=target.not_running)
    reply = ask(target.socket_path, HealRequest(), timeout=HEAL_TIMEOUT)
    if reply.outcome is Outcome.OK and reply.layout is not None:
        return answer("healed", reply.layout.version, reply.layout.digest)
    return answer(unsuccessful_result(reply), detail=reply.reason)


def render_heal(report: HealReport) -> list[str]:
    lines = []
    for answer in report.daemons:
        where = answer.socket_path or "-"
        if answer.ledger is not None:
            where = f"{answer.ledger} (socket {where})"
        if answer.result == "healed":
            lines.append(
                f"{where}: healed from its checkpoint: clean at version {answer.version} "
                f"(digest {str(answer.digest)[:12]})"
            )
        elif answer.result == "not_running":
            why = answer.detail or "no daemon listens on its socket"
            lines.append(f"{where}: not running ({why}); a daemon started now loads clean")
        elif answer.result == "older_daemon":
            lines.append(f"{where}: this daemon does not know heal: {answer.detail}")
        else:
            lines.append(f"{where}: {answer.result}: {answer.detail}")
    return lines
