"""Ledger text reaches the terminal shown, never obeyed: its control characters come out escaped.

A ledger is a file: a hand edit, a damaged disk or another program may put anything in it, and
the daemon's own refusal of such engine ids does not protect a file it did not write. Each
ledger here is a real one (tests/cli_ledgers.py) changed afterwards with plain ``sqlite3``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from cli_ledgers import at, build, execute, run_cli

from layout_ledger.cli import exit_codes

EVIL_ENGINE = "engine-a\n\x1b[2J\x1b[8m"
EVIL_ENGINE_SHOWN = "engine-a\\n\\x1b[2J\\x1b[8m"
_EVIL_ENGINE_SQL = "'engine-a' || char(10) || char(27) || '[2J' || char(27) || '[8m'"


def forge(path: Path, *, digests: bool = True) -> Path:
    """Engine ids, reasons, the daemon label and (with ``digests``) the digests of a built
    ledger, rewritten to hold terminal control sequences and a forged line."""
    statements = [
        "PRAGMA ignore_check_constraints = ON",
        f"UPDATE events SET engine_id = {_EVIL_ENGINE_SQL} WHERE engine_id = 'engine-a'",
        f"UPDATE versions SET engine_id = {_EVIL_ENGINE_SQL} WHERE engine_id = 'engine-a'",
        "UPDATE events SET reason = reason || char(10) || 'state: clean' WHERE reason IS NOT NULL",
        "UPDATE incarnations SET daemon_label = daemon_label || char(27) || ']0;owned' || char(7)",
    ]
    if digests:
        statements.append(
            "UPDATE versions SET digest = char(27) || '[2J' || substr(digest, 5) WHERE version > 0"
        )
    execute(path, *statements)
    return path


def _terminal_safe(text: str) -> bool:
    return all(char == "\n" or char.isprintable() for char in text)


# Each command with the arguments it needs; every one of them meets some ledger text.
ARGUMENTS = {
    "status": [],
    "history": [],
    "show": [],
    "diff": ["0", "1", "--slots"],
    "export": ["-o", "{tmp}/out.json"],
    "verify": [],
    "plot": ["-o", "{tmp}/out.png", "--moves"],
    "prune": ["--keep", "1"],
    "upgrade": [],
}


@pytest.mark.parametrize("digests", [True, False], ids=["forged-digests", "true-digests"])
@pytest.mark.parametrize("kind", ["clean", "dirty"])
@pytest.mark.parametrize("command", sorted(ARGUMENTS))
def test_no_command_writes_a_control_character_taken_from_a_ledger_to_the_terminal(
    tmp_path, capsys, command, kind, digests
):
    path = forge(build(kind, tmp_path / "l.sqlite"), digests=digests)
    argv = [command, str(path)] + [a.format(tmp=tmp_path) for a in ARGUMENTS[command]]
    with warnings.catch_warnings(record=True) as caught:  # a warning is printed on stderr too
        warnings.simplefilter("always")
        code, out, err = run_cli(capsys, *argv)
    assert code != 0 or out, err
    assert _terminal_safe(out), out
    assert _terminal_safe(err), err
    assert all(_terminal_safe(str(warning.message)) for warning in caught), caught
    assert err.count("\n") <= 1
    assert not any(line.startswith("state: clean") for line in (out + err).splitlines())


def test_ledger_text_in_human_output_is_shown_with_backslash_escapes(tmp_path, capsys):
    path = forge(build("clean", tmp_path / "l.sqlite"), digests=False)
    code, out, _ = run_cli(capsys, "status", str(path))
    assert code == exit_codes.NOT_RUNNING  # its daemon was killed
    assert f"attached:            {EVIL_ENGINE_SHOWN}\n" in out
    assert f"last event:          {at(16)} commit {EVIL_ENGINE_SHOWN}; " in out
    _, out, _ = run_cli(capsys, "history", str(path), "--kind", "begin_busy", "--kind", "start")
    assert out.splitlines()[-1] == (
        f"{at(11)}  inc=2  #12  begin_busy engine={EVIL_ENGINE_SHOWN} version=2  "
        "(engine-b is attached\\nstate: clean)"
    )
    assert out.splitlines()[0].endswith("  (test-daemon\\nstate: clean)")


def test_a_forged_line_in_a_dirty_reason_stays_inside_its_event_line(tmp_path, capsys):
    path = forge(build("dirty", tmp_path / "l.sqlite"), digests=False)
    code, out, _ = run_cli(capsys, "history", str(path), "--kind", "dirty")
    assert code == exit_codes.OK
    (line,) = out.splitlines()
    assert line.endswith("and the engines that use it\\nstate: clean)")
    code, out, _ = run_cli(capsys, "status", str(path))
    assert code == exit_codes.DIRTY
    assert f"dirty:               yes, since {at(5)}; " in out
    assert f" ago: engine '{EVIL_ENGINE_SHOWN}' detached" in out
    assert out.splitlines()[-1] == "state:               dirty"


def test_a_forged_digest_is_escaped_in_human_output_and_in_the_error_line(tmp_path, capsys):
    path = forge(build("dirty", tmp_path / "l.sqlite"))
    _, out, _ = run_cli(capsys, "status", str(path))
    assert "digest:              \\x1b[2J" in out
    code, out, err = run_cli(capsys, "export", str(path), "-o", str(tmp_path / "x.json"))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert "do not give its recorded digest \\x1b[2J" in err


def test_an_error_line_listing_ledger_engine_ids_escapes_them(tmp_path, capsys):
    path = forge(build("clean", tmp_path / "l.sqlite"), digests=False)
    code, out, err = run_cli(capsys, "history", str(path), "--engine", "engine")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        "layout-ledger history: error: --engine 'engine' matches 3 engines: "
        f"'{EVIL_ENGINE_SHOWN}', 'engine-b', 'engine-old'; give more of the id\n"
    )


def test_json_output_keeps_the_ledger_text_exact(tmp_path, capsys):
    path = forge(build("clean", tmp_path / "l.sqlite"), digests=False)
    _, out, _ = run_cli(capsys, "status", str(path), "--json")
    assert _terminal_safe(out)
    (status,) = json.loads(out)["ledgers"]
    assert status["attached"] == [EVIL_ENGINE]
    assert status["daemon_label"] == "test-daemon\x1b]0;owned\x07"


def test_csv_rows_escape_ledger_text_and_nl_rows_keep_it_exact(tmp_path, capsys):
    path = forge(build("clean", tmp_path / "l.sqlite"), digests=False)
    _, out, _ = run_cli(capsys, "history", str(path), "--engine", "engine-a", "--csv")
    assert _terminal_safe(out.replace("\r\n", "\n"))
    assert f",{EVIL_ENGINE_SHOWN}," in out
    _, out, _ = run_cli(capsys, "history", str(path), "--engine", "engine-a", "--nl")
    assert _terminal_safe(out)
    assert {json.loads(line)["engine_id"] for line in out.splitlines()} == {EVIL_ENGINE}
