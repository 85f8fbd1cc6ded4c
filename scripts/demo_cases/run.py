"""The whole demo: cases 1-3, the forensics of case 3 (b)'s dirty ledger, then case 4 on the
same daemons, then case 5 (a warm standby beside a rebalancing engine), case 6 (a restart
keeps the balance), case 7 (a dirty daemon heals itself) and case 7 (b) (daemons at different
versions converge) on their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo_cases.answers import Answers
from demo_cases.case1 import run_case1, run_case1_without_plugin
from demo_cases.case2 import run_case2
from demo_cases.case3 import run_case3
from demo_cases.case4 import run_case4
from demo_cases.case5 import run_case5
from demo_cases.case6 import run_case6
from demo_cases.case7 import run_case7
from demo_cases.case7b import run_case7b
from demo_cases.config import DemoConfig
from demo_cases.forensics import CommandOutput, run_forensics
from demo_cases.results import CaseResult, Check
from demo_cases.workspace import Workspace


@dataclass
class DemoRun:
    config: DemoConfig
    forkserver_seconds: float = 0.0
    cases: list[CaseResult] = field(default_factory=list)
    commands: list[CommandOutput] = field(default_factory=list)
    query: tuple[str, list[str], list[tuple[Any, ...]]] | None = None
    answers: Answers = field(default_factory=Answers)  # what the engines answered

    @property
    def failed(self) -> list[tuple[str, Check]]:
        return [(case.title, check) for case in self.cases for check in case.failed]


def run_demo(
    workspace: Workspace,
    readme: Path,
    on_case: Callable[[CaseResult], None] | None = None,
) -> DemoRun:
    """Every case in order; ``on_case`` sees each result as soon as it is ready."""
    run = DemoRun(workspace.config)
    if workspace.context is None:
        workspace.start_processes()
    run.forkserver_seconds = workspace.startup_seconds

    def done(case: CaseResult) -> CaseResult:
        run.cases.append(case)
        if on_case is not None:
            on_case(case)
        return case

    case1 = done(run_case1(workspace))
    done(run_case1_without_plugin(workspace, case1.facts.get("a_map")))
    done(run_case2(workspace))
    case3, dirty_daemons, dirty_experts = run_case3(workspace)
    done(case3)
    forensics, run.commands, run.query = run_forensics(dirty_daemons[0].ledger_path, readme, case3)
    forensics.facts.update(commands=run.commands, query=run.query)
    done(forensics)
    repaired, refused = run_case4(workspace, dirty_daemons, dirty_experts, case3)
    done(repaired)
    done(refused)
    standby, standby_more = run_case5(workspace)
    done(standby)
    done(standby_more)
    done(run_case6(workspace))
    done(run_case7(workspace))
    done(run_case7b(workspace))
    run.answers = workspace.answers
    return run
