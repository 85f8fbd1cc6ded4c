"""The README stays short and true: what it names exists, what it shows runs.

At most 12 KB; every ``layout-ledger`` command it shows parses with the command's own parser;
every setting it names (an ``SGLANG_EXPERT_LAYOUT_*`` variable, an ``--expert-layout-*`` flag)
is a row of ``sglang_integration/settings.py`` (rows may be added there without touching the
README); the exit codes it gives for ``fleet`` are the ones ``fleet --help`` lists; every link
lands on a file, and on a heading of it. The first look's commands and their output are run by
tests/test_runbook_examples.py; the install it documents by tests/test_package_install.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from layout_ledger.cli.parser import UsageError, parse, verb_exit_codes
from sglang_integration import settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_BYTES = 12 * 1024


def _text() -> str:
    return README.read_text()


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _commands() -> list[str]:
    """Every ``layout-ledger ...`` the README shows: in code spans and after ``$ ``."""
    text = _text()
    found = re.findall(r"`(layout-ledger [^`]+)`", text)
    found += re.findall(r"^\$ (layout-ledger .+)$", text, flags=re.MULTILINE)
    return found


def test_the_readme_is_at_most_12_kb():
    assert len(README.read_bytes()) <= MAX_BYTES


@pytest.mark.parametrize("command", sorted(set(_commands())))
def test_every_command_the_readme_shows_parses_with_the_commands_own_parser(command):
    argv = shlex.split(command.replace("[LEDGER...]", "").replace("[options]", ""))[1:]
    if argv[0] == "COMMAND":
        return  # the synopsis
    try:
        parse(argv)
    except UsageError as exc:
        pytest.fail(f"{command}: {exc}")


def test_every_setting_the_readme_names_is_a_row_of_the_settings_module():
    text = _text()
    variables = set(re.findall(r"SGLANG_EXPERT_LAYOUT_[A-Z_]+", text))
    flags = set(re.findall(r"--expert-layout-[a-z-]+", text))
    assert variables and flags
    assert variables <= {setting.env for setting in settings.SETTINGS}
    assert flags <= {flag for flag, _ in settings.DAEMON_FLAGS}


def test_the_fleet_exit_codes_the_readme_gives_are_the_ones_fleet_help_lists():
    sentence = re.search(r"`fleet` applies the engine's own startup rule.*?\n\n", _text(), re.S)
    assert sentence is not None
    given = {int(code) for code in re.findall(r"\b(\d) (?:when|while)\b", sentence.group(0))}
    given |= {int(code) for code in re.findall(r"exits (\d) when", sentence.group(0))}
    listed = {code for code, _ in verb_exit_codes("fleet")} - {7, 130}  # --ready-to-stop, Ctrl-C
    assert given == listed


def test_every_link_of_the_readme_lands_on_a_file_and_a_heading():
    for target in re.findall(r"\]\(([^)]+)\)", _text()):
        path, _, fragment = target.partition("#")
        assert (ROOT / path).exists(), target
        if fragment:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.MULTILINE)
            assert fragment in {_anchor(heading) for heading in headings}, target


def test_the_readme_documents_one_install_the_one_the_package_test_makes():
    text = _text()
    assert "python -m pip install .  " in text
    assert "pip install -e" not in text
