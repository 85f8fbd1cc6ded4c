"""Bad arguments and unusable files: one line on stderr, a non-zero exit, never a traceback.

Most cases run ``main(argv)`` in this process; a few run the installed ``layout-ledger``
console script, the way an operator does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_ledgers import build, execute, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.cli.parser import COMMANDS

CONSOLE_SCRIPT = Path(sys.executable).with_name("layout-ledger")

# Each command with the extra arguments it needs to reach the ledger file.
ARGUMENTS = {
    "status": [],
    "history": [],
    "show": [],
    "diff": ["0", "1"],
    "export": ["-o", "{tmp}/out.json"],
    "verify": [],
    "plot": ["-o", "{tmp}/out.png"],
    "prune": ["--keep", "1"],
    "upgrade": [],
    "fleet": [],
    "metrics": [],
    "backup": ["{tmp}/copy.sqlite"],
    "cordon": [],
    "uncordon": [],
    "heal": [],
    "retire": [],
    "unretire": [],
}


def test_the_table_of_arguments_covers_every_command():
    assert set(ARGUMENTS) == set(COMMANDS)


def _missing(tmp: Path) -> Path:
    return tmp / "nowhere" / "ledger.sqlite"


def _not_sqlite(tmp: Path) -> Path:
    path = tmp / "notes.sqlite"
    path.write_text("these are not the pages you are looking for\n" * 200)
    return path


def _empty_sqlite(tmp: Path) -> Path:
    path = tmp / "empty.sqlite"
    execute(path)
    return path


def _other_sqlite(tmp: Path) -> Path:
    path = tmp / "other.sqlite"
    execute(path, "CREATE TABLE recipes (name TEXT)")
    return path


def _newer_schema(tmp: Path) -> Path:
    path = build("clean", tmp / "newer.sqlite")
    execute(path, "UPDATE alembic_version SET version_num = '0099_from_the_future'")
    return path


def _directory(tmp: Path) -> Path:
    path = tmp / "a-directory"
    path.mkdir()
    return path


UNUSABLE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing": (_missing, "does not exist"),
    "not SQLite": (_not_sqlite, "SQLite database"),
    "empty SQLite": (_empty_sqlite, "empty SQLite file"),
    "another SQLite file": (_other_sqlite, "is not an expert layout ledger"),
    "newer schema": (_newer_schema, "newer than this code knows"),
    "a directory": (_directory, "is not a regular file"),
}


@pytest.mark.parametrize("command", sorted(ARGUMENTS))
@pytest.mark.parametrize("case", sorted(UNUSABLE))
def test_an_unusable_file_gives_one_line_and_exit_2_and_stays_as_it_was(
    tmp_path, capsys, command, case
):
    make, expected = UNUSABLE[case]
    path = make(tmp_path)
    before = path.read_bytes() if path.is_file() else None
    argv = [command, str(path)] + [a.format(tmp=tmp_path) for a in ARGUMENTS[command]]
    code, out, err = run_cli(capsys, *argv)
    assert code == exit_codes.UNUSABLE, err
    assert out == ""
    assert err.startswith(f"layout-ledger {command}: error: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.png").exists()
    assert not (tmp_path / "copy.sqlite").exists()
    assert (path.read_bytes() if path.is_file() else None) == before
    assert path.exists() == (case != "missing")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            "DELETE FROM versions WHERE incarnation_id = 2",
            "incarnation 2 has no version rows (not even its first); the ledger is damaged, run "
            "`layout-ledger verify`",
        ),
        (
            "UPDATE layout_rows SET slots = '[1,2' WHERE version = 3 AND layer = 0",
            "(JSONDecodeError: Expecting ',' delimiter: line 1 column 5 (char 4))",
        ),
    ],
)
@pytest.mark.parametrize("command", ["status", "show", "diff", "export", "plot"])
def test_a_damaged_ledger_gives_one_line_pointing_to_verify(
    tmp_path, capsys, damage, expected, command
):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, damage)
    argv = [command, str(path)] + [a.format(tmp=tmp_path) for a in ARGUMENTS[command]]
    if command == "diff":
        argv[2:4] = ["2", "3"]
    code, out, err = run_cli(capsys, *argv)
    if command == "status" and "JSON" in expected:
        assert code == exit_codes.NOT_RUNNING  # status reads no row's slots; daemon killed
        return
    assert (code, out) == (exit_codes.UNUSABLE, "")
    if expected.startswith("("):  # a driver-level failure the CLI wraps
        expected = f"the ledger {path} looks damaged {expected}; run `layout-ledger verify {path}`"
    assert err == f"layout-ledger {command}: error: {expected}\n"


BAD_ARGUMENTS = [
    ([], "the following arguments are required: COMMAND"),
    (["frobnicate", "x"], "argument COMMAND: invalid choice: 'frobnicate'"),
    (["prune", "L"], "the following arguments are required: --keep"),
    (["prune", "L", "--keep", "0"], "argument --keep: expected a number >= 1, got 0"),
    (["show", "L", "--version", "-1"], "argument --version: expected a number >= 0, got -1"),
    (["show", "L", "--layers", "1,x"], "argument --layers: expected layers like 0,3,5-7"),
    (["show", "L", "--layers", "5-2"], "argument --layers: bad layer range '5-2'"),
    (["show", "L", "--ep-size", "two"], "argument --ep-size: expected a whole number"),
    (["history", "L", "--kind", "explode"], "argument --kind: invalid choice: 'explode'"),
    (
        ["history", "L", "--since", "last tuesday"],
        "argument --since: expected a time like 2026-11-29T13:00:00Z, 13:00, today",
    ),
    (["diff", "L", "1"], "the following arguments are required: V2"),
    (["export", "L"], "the following arguments are required: -o/--output"),
    (["export", "L", "-o", "x.json", "--check"], "export --check needs --model-path DIR"),
    (["plot", "L", "-o", "x.png", "--size", "big"], "argument --size: expected WIDTHxHEIGHT"),
    (["status", "L", "--bogus"], "unrecognized arguments: --bogus"),
    (["diff", "L", "1", "2", "3"], "expected [LEDGER] V1 V2"),
    (["diff", "L", "x", "2"], "argument V1: expected a whole number, got 'x'"),
    (["metrics", "L", "--serve", "9400"], "argument --serve: expected HOST:PORT"),
    (["metrics", "L", "--serve", "h:99999"], "argument --serve: expected a port 0..65535"),
    (["metrics", "L", "--label", "engine"], "argument --label: expected KEY=VALUE"),
    (
        ["metrics", "L", "--serve", ":0", "--json"],
        "metrics --serve prints no -o file and no --json",
    ),
    (["backup"], "the following arguments are required: DEST"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS)
def test_a_bad_command_line_gives_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err.startswith("layout-ledger") and ": error: " in err
    assert message in err
    assert err.count("\n") == 1


def test_a_ledger_path_this_user_cannot_read_gives_one_line_and_exit_2(tmp_path):
    """As root, run the console script as 'nobody'; otherwise take the read bit away."""
    directory = Path(tempfile.mkdtemp(prefix="ledger-unreadable-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        path = build("clean", directory / "l.sqlite")
        path.chmod(0o600)
        command = [str(CONSOLE_SCRIPT), "status", str(path)]
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("running as root without setpriv: cannot drop to another user")
            command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        else:
            path.chmod(0o000)
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=60, cwd="/", check=False
        )
    finally:
        shutil.rmtree(directory)
    assert result.returncode == exit_codes.UNUSABLE
    assert result.stdout == ""
    assert (
        result.stderr
        == f"layout-ledger status: error: ledger {path} is not readable by this user\n"
    )


@pytest.mark.timeout(120)
def test_the_console_script_reports_a_missing_ledger_in_one_line(tmp_path):
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "verify", str(tmp_path / "gone.sqlite"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == exit_codes.UNUSABLE
    assert result.stdout == ""
    assert result.stderr == (
        f"layout-ledger verify: error: ledger {tmp_path / 'gone.sqlite'} does not exist; check "
        "the path: `layout-ledger fleet` given no PATH lists the daemons' ledgers here\n"
    )


@pytest.mark.timeout(120)
def test_the_console_script_reports_a_bad_argument_in_one_line():
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "show", "L", "--layers", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == exit_codes.UNUSABLE
    assert result.stderr == (
        "layout-ledger show: error: argument --layers: expected layers like 0,3,5-7, got 'x' "
        "(see layout-ledger show --help)\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        *([command, "--help"] for command in sorted(COMMANDS)),
    ],
)
def test_help_exits_0(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert (code, err) == (exit_codes.OK, "")
    assert out.startswith("usage: layout-ledger")
