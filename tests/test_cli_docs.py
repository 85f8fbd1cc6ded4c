"""Every command has help text and is documented (docs/cli.md, and the README's table)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from layout_ledger.cli import exit_codes
from layout_ledger.cli.parser import (
    COMMANDS,
    VERB_EXAMPLES,
    build_parser,
    exit_codes_line,
    verb_epilog,
    verb_exit_codes,
)
from layout_ledger.store.schema import KNOWN_REVISIONS, SCHEMA_HEAD

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_is_registered_with_the_parser():
    assert set(_subparsers()) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_and_each_of_its_options_has_help_text(name):
    parser = _subparsers()[name]
    assert parser.description and parser.epilog == verb_epilog(name)
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}"
    assert "--json" in parser.format_help()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_is_documented_in_docs_cli_md_with_an_example_and_its_json(name):
    text = CLI_DOC.read_text()
    sections = re.split(r"^### ", text, flags=re.MULTILINE)
    (section,) = (s for s in sections if s.startswith(f"`{name}`"))
    assert f"$ layout-ledger {name} " in section
    assert "`--json`" in section


def test_every_exit_code_is_documented():
    text = CLI_DOC.read_text()
    codes = {
        value
        for name, value in vars(exit_codes).items()
        if name.isupper() and isinstance(value, int)
    }
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", text, flags=re.MULTILINE)}
    assert documented == codes


def _cli_section(document: Path) -> str | None:
    """A document's command-line section: from a heading naming it to the next heading of the
    same or a higher level."""
    lines = document.read_text().splitlines()
    for start, line in enumerate(lines):
        match = re.match(r"^(#+) .*((?<![\w-])layout-ledger(?![\w-])|[Cc]ommand line)", line)
        if match:
            level = len(match.group(1))
            end = next(
                (
                    n
                    for n in range(start + 1, len(lines))
                    if re.match(rf"^#{{1,{level}}} ", lines[n])
                ),
                len(lines),
            )
            return "\n".join(lines[start:end])
    return None


def _mentions(section: str, name: str) -> bool:
    return re.search(rf"(layout-ledger {name}\b|`{name}`)", section) is not None


def test_docs_cli_md_is_a_section_the_readme_check_recognises_whole():
    section = _cli_section(CLI_DOC)
    assert section is not None and section.startswith("## Command line: `layout-ledger`")
    assert all(_mentions(section, name) for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_appears_in_the_readme(name):
    section = _cli_section(README)
    assert section is not None, "README.md has no command-line section"
    assert _mentions(section, name), f"README.md's command-line section lacks {name}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_commands_help_shows_its_examples_and_its_own_exit_codes(name):
    shown = _subparsers()[name].format_help()
    examples, _, codes = shown.partition("examples:\n")[2].partition("\nexit codes:\n")
    assert [line.strip() for line in examples.strip().splitlines()] == list(VERB_EXAMPLES[name])
    assert all(
        example == f"layout-ledger {name}" or example.startswith(f"layout-ledger {name} ")
        for example in VERB_EXAMPLES[name]
    )
    listed = [int(line.split()[0]) for line in codes.strip().splitlines()]
    assert listed == [code for code, _ in verb_exit_codes(name)]
    known = {value for key, value in vars(exit_codes).items() if key.isupper()}
    assert set(listed) <= known


def _readme_examples() -> dict[str, str]:
    """The README's command table: command -> its example column."""
    found = {}
    for line in README.read_text().splitlines():
        match = re.match(r"^\| `([a-z-]+)` \|.*\| `([^`]+)` \|$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_readmes_example_of_each_command_is_the_first_its_help_shows(name):
    assert _readme_examples().get(name) == VERB_EXAMPLES[name][0]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_docs_cli_md_gives_each_command_the_exit_codes_its_help_lists(name):
    sections = re.split(r"^### ", CLI_DOC.read_text(), flags=re.MULTILINE)
    (section,) = (s for s in sections if s.startswith(f"`{name}`"))
    line = f"Exit codes (as `layout-ledger {name} --help` lists them): {exit_codes_line(name)}."
    assert line in section.splitlines()


@pytest.mark.parametrize("document", ["README.md", "docs/cli.md", "docs/operations.md"])
def test_the_schema_a_documented_output_names_is_the_migrations_head(document):
    """An output shown in the docs (verify, upgrade, backup) is this code's: it names the
    newest schema revision (a new migration updates the examples); only `upgrade`'s "from
    schema R" names an older one."""
    text = (ROOT / document).read_text()
    names = r"\d{4}_[a-z][a-z_]*[a-z]"
    named = re.findall(rf"(from schema |schema |to )({names})", text)
    assert all(revision in KNOWN_REVISIONS for _, revision in named), named
    shown = [revision for before, revision in named if before != "from schema "]
    assert set(shown) <= {SCHEMA_HEAD}, f"{document} shows schema {sorted(set(shown))}"
