"""A rule of the command line's terminal output (``layout_ledger.cli.terminal``) that a plausible
bug could break without any other test noticing: text from a ledger is shown with every
character a terminal could act on escaped, the Unicode format characters (zero-width and
bidirectional marks) and the line and paragraph separators included, not only the controls.

A bidirectional override makes a terminal show text in another order than it is stored (an
engine id that reads as another); zero-width characters make two different ids look the same.
The ledgers are real ones (tests/cli_ledgers.py) edited with plain ``sqlite3``.
"""

from __future__ import annotations

import json
import unicodedata

import pytest
from cli_ledgers import build, execute, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.cli.terminal import printable

FORMAT_CHARACTERS = {
    "\u00ad": "soft hyphen",
    "\u061c": "arabic letter mark",
    "\u200b": "zero width space",
    "\u200c": "zero width non-joiner",
    "\u200d": "zero width joiner",
    "\u200e": "left-to-right mark",
    "\u200f": "right-to-left mark",
    "\u202a": "left-to-right embedding",
    "\u202b": "right-to-left embedding",
    "\u202c": "pop directional formatting",
    "\u202d": "left-to-right override",
    "\u202e": "right-to-left override",
    "\u2060": "word joiner",
    "\u2066": "left-to-right isolate",
    "\u2067": "right-to-left isolate",
    "\u2068": "first strong isolate",
    "\u2069": "pop directional isolate",
    "\ufeff": "zero width no-break space",
    "\U000e0001": "language tag",
}
SEPARATORS = {"\u2028": "line separator", "\u2029": "paragraph separator"}


@pytest.mark.parametrize(
    "char", sorted({**FORMAT_CHARACTERS, **SEPARATORS}), ids=lambda c: f"U+{ord(c):04X}"
)
def test_a_format_character_or_separator_is_written_as_its_escape(char: str) -> None:
    assert unicodedata.category(char) in {"Cf", "Zl", "Zp"}
    code = ord(char)
    escape = (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )
    assert printable(f"engine{char}-a") == f"engine{escape}-a"


def test_visible_text_of_any_script_is_shown_as_it_is() -> None:
    text = "engine-ä ムーン שלום 引擎 \u0301e"  # letters, a combining mark, spaces
    assert printable(text) == text


def test_controls_are_still_escaped() -> None:
    assert printable("a\nb\x1b[2J\x85\x9b\x7f") == "a\\nb\\x1b[2J\\x85\\x9b\\x7f"


ID_THAT_READS_BACKWARDS = "engine-\u202eb-enigne\u202c-\u200bx"
SHOWN = "engine-\\u202eb-enigne\\u202c-\\u200bx"


def test_an_engine_id_with_bidirectional_and_zero_width_marks_is_shown_escaped(
    tmp_path, capsys
) -> None:
    path = build("clean", tmp_path / "l.sqlite")
    sql_id = "'engine-' || char(8238) || 'b-enigne' || char(8236) || '-' || char(8203) || 'x'"
    execute(
        path,
        "PRAGMA ignore_check_constraints = ON",
        f"UPDATE events SET engine_id = {sql_id} WHERE engine_id = 'engine-a'",
        f"UPDATE versions SET engine_id = {sql_id} WHERE engine_id = 'engine-a'",
        "UPDATE events SET reason = reason || char(8207) || char(8296) WHERE kind = 'start'",
    )
    for argv in (
        ["status"],
        ["history"],
        ["history", "--csv"],
        ["show"],
    ):
        code, out, err = run_cli(capsys, argv[0], str(path), *argv[1:])
        # The ledger's daemon is not running: status says so (6); the others read it.
        expected = exit_codes.NOT_RUNNING if argv == ["status"] else exit_codes.OK
        assert code == expected, (argv, err)
        leaked = sorted({f"U+{ord(c):04X}" for c in out + err if c in FORMAT_CHARACTERS})
        assert leaked == [], (argv, out)
    _, out, _ = run_cli(capsys, "status", str(path))
    assert f"attached:            {SHOWN}\n" in out
    _, out, _ = run_cli(capsys, "history", str(path), "--kind", "start")
    assert out.splitlines()[0].endswith("  (test-daemon\\u200f\\u2068)")
    _, out, _ = run_cli(capsys, "status", str(path), "--json")
    assert json.loads(out)["ledgers"][0]["attached"] == [
        ID_THAT_READS_BACKWARDS
    ]  # --json keeps it exact
