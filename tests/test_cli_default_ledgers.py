"""One ledger location: the daemon writes where the CLI, given no PATH, reads.

The default (``layout_ledger.store.locations``) is /var/lib/sglang/expert_layouts/ for root and
$XDG_STATE_HOME/sglang/expert_layouts/ for another user; ``SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE``
replaces it on both sides. Every command that takes ledgers takes none to mean those, and says on
stderr which template it read and why.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from cli_ledgers import build, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.cli.parser import COMMANDS, VERB_EXAMPLES
from layout_ledger.store import locations
from sglang_integration import settings
from sglang_integration.daemon import ledger_paths

ROOT = Path(__file__).resolve().parent.parent
ENV = locations.TEMPLATE_ENV

# Each command with no PATH, its other arguments ({tmp}: a scratch directory), and its exit code
# on one clean ledger whose daemon does not run.
NO_PATH = {
    "status": ([], exit_codes.NOT_RUNNING),
    "history": (["--last", "1"], exit_codes.OK),
    "show": ([], exit_codes.OK),
    "diff": (["1", "2"], exit_codes.OK),
    "export": (["-o", "{tmp}/layout.json"], exit_codes.OK),
    "verify": ([], exit_codes.OK),
    "prune": (["--keep", "1", "--dry-run"], exit_codes.OK),
    "upgrade": ([], exit_codes.OK),
    "fleet": ([], exit_codes.NOT_RUNNING),
    "metrics": ([], exit_codes.OK),
    "backup": (["{tmp}/"], exit_codes.OK),
    "cordon": ([], exit_codes.NOT_RUNNING),
    "uncordon": ([], exit_codes.NOT_RUNNING),
    "heal": ([], exit_codes.NOT_RUNNING),
    "retire": ([], exit_codes.OK),
    "unretire": ([], exit_codes.OK),
}


@pytest.fixture
def one_ledger(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "ledgers"
    directory.mkdir()
    monkeypatch.setenv(ENV, str(directory / "expert_layout_{device_uuid}.sqlite"))
    return build("clean", directory / "expert_layout_GPU-0.sqlite")


def test_every_command_that_takes_ledgers_is_covered_here():
    assert set(NO_PATH) | {"plot"} == set(COMMANDS)  # plot: as show (matplotlib aside)


@pytest.mark.parametrize("verb", sorted(NO_PATH))
def test_every_command_given_no_path_reads_the_daemons_template_and_says_so(
    verb, one_ledger, tmp_path, capsys
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv, expected = NO_PATH[verb]
    code, _, err = run_cli(capsys, verb, *(arg.format(tmp=scratch) for arg in argv))
    template = os.environ[ENV]
    note = f"layout-ledger {verb}: the daemons' ledgers on this host: {template} ({ENV})\n"
    assert err.startswith(note), err
    assert code == expected, err


def test_with_the_variable_unset_no_path_is_this_users_default_location(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    # Where a daemon of this user writes, with no setting: the same directory.
    written = ledger_paths.prepare_ledger_path("GPU-7")
    assert written == f"{tmp_path}/state/sglang/expert_layouts/expert_layout_GPU-7.sqlite"
    build("clean", Path(written))
    code, out, err = run_cli(capsys, "status")
    assert code == exit_codes.NOT_RUNNING
    assert out.startswith(f"ledger:              {written}\n")
    assert err == (
        "layout-ledger status: the daemons' ledgers on this host: "
        f"{tmp_path}/state/sglang/expert_layouts/expert_layout_{{device_uuid}}.sqlite (the "
        f"default for uid 1000; {ENV} unset)\n"
    )


def test_the_daemon_and_the_cli_hold_one_default_template(monkeypatch):
    for euid in (0, 1000):
        monkeypatch.setattr(os, "geteuid", lambda euid=euid: euid)
        monkeypatch.delenv(ENV, raising=False)
        assert ledger_paths.ledger_template() == locations.ledgers_on_this_host().template
        monkeypatch.setenv(ENV, "/srv/l/{device_uuid}.sqlite")
        assert ledger_paths.ledger_template() == locations.ledgers_on_this_host().template
    assert settings.LEDGER_TEMPLATE.env == ENV
    assert settings.LEDGER_TEMPLATE.default_text == locations.DEFAULT_TEXT


def test_no_path_and_no_ledger_there_says_where_it_looked_and_what_to_pass(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(ENV, f"{tmp_path}/none/{{device_uuid}}.sqlite")
    code, out, err = run_cli(capsys, "fleet")
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err == (
        "layout-ledger fleet: error: no PATH given, and no ledger matches the daemons' ledger "
        f"template on this host, {tmp_path}/none/{{device_uuid}}.sqlite ({ENV}): name the "
        f"ledgers (`layout-ledger fleet PATH`), or set {ENV} to the template the daemons were "
        "given (--expert-layout-ledger)\n"
    )


def test_a_command_of_one_ledger_given_no_path_refuses_a_template_that_matches_many(
    one_ledger, capsys
):
    build("clean", one_ledger.with_name("expert_layout_GPU-1.sqlite"))
    code, out, err = run_cli(capsys, "verify")
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert "matches 2 ledgers" in err and "verify reads one: name it" in err


# Every ledger path the docs and --help show lies in the one default directory (or is the
# runbook's scratch incident, a backup, or an explicit example of another template).
_LEDGER_PATH = re.compile(r"[\w./${}~-]*expert_layouts?_[\w{}-]*\.sqlite")
_DEFAULT_DIRECTORIES = (
    "/var/lib/sglang/expert_layouts/",
    "$XDG_STATE_HOME/sglang/expert_layouts/",
    "~/.local/state/sglang/expert_layouts/",
)


def _shown_paths() -> list[tuple[str, str]]:
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        (document.name, path)
        for document in documents
        for path in _LEDGER_PATH.findall(document.read_text())
    ]
    found += [
        ("--help", path)
        for examples in VERB_EXAMPLES.values()
        for example in examples
        for path in _LEDGER_PATH.findall(example)
    ]
    return found


def test_every_ledger_path_the_docs_and_help_show_is_in_the_one_default_directory():
    shown = _shown_paths()
    assert len(shown) >= 10
    elsewhere = [
        (where, path)
        for where, path in shown
        if "/" in path and not path.startswith(_DEFAULT_DIRECTORIES) and "/backups/" not in path
    ]
    assert elsewhere == []
