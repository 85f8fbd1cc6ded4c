"""Rules of the ledger file (``layout_ledger.store``: ``chain``, ``event_writer``, ``files``) that
a plausible bug could break without any other test noticing; each test names its rule.

- Each event's chain value covers all of the event's fields, a refusal's or a dirty mark's
  ``reason`` included, so an edit of any field fails ``verify``.
- Identical consecutive refusals share one row only when their reason is the same too.
- Every companion of a ledger that exists (``-wal``, ``-shm``, ``-journal``, ``.lock``) must be a
  regular file of the ledger's owner that nobody else may write, group included, before SQLite
  reads it.

Real ledgers (tests/cli_ledgers.py, the ledger's own writer), edited with plain ``sqlite3``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest
from cli_ledgers import build, execute, query, run_cli
from ledger_support import open_ledger, start

from layout_ledger.cli import exit_codes
from layout_ledger.core import errors
from layout_ledger.core.errors import LedgerFileError
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store import chain
from layout_ledger.store.files import COMPANION_SUFFIXES, check_companions

# --- the chain covers every field ---------------------------------------------------------------

_ROW = (2, "2026-01-01T00:00:06.000000+00:00", "fetch_refused", "engine-b", None, None, 1, None)
_FIELDS = (*_ROW, "dirty", 1, None)


@pytest.mark.parametrize("index", range(len(chain.FIELDS)), ids=list(chain.FIELDS))
def test_a_chain_link_changes_with_every_field_of_its_event(index: int) -> None:
    changed = list(_FIELDS)
    changed[index] = "edited" if changed[index] is None else f"{changed[index]}-edited"
    assert chain.link(chain.GENESIS, changed) != chain.link(chain.GENESIS, _FIELDS)


def test_a_chain_link_changes_with_its_predecessor() -> None:
    assert chain.link("1" * 64, _FIELDS) != chain.link(chain.GENESIS, _FIELDS)


@pytest.mark.parametrize(
    ("event_id", "what"),
    [
        (8, "a refusal's reason"),
        (6, "a detach's reason"),
        (7, "a dirty mark's reason"),
    ],
)
def test_editing_the_reason_of_any_event_fails_verify_through_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], event_id: int, what: str
) -> None:
    # The "dirty" ledger: #6 detach and #7 dirty mark, #8 a refused fetch (reason "dirty").
    path = build("dirty", tmp_path / "l.sqlite")
    execute(path, f"UPDATE events SET reason = 'all clean here' WHERE event_id = {event_id}")
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT, what
    assert (
        f"chain: INCONSISTENT: event #{event_id}'s chain value does not follow from the rows "
        f"before it" in out
    ), out


def test_editing_a_content_dirty_marks_reason_fails_verify_through_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    try:
        start(ledger).mark_content_dirty([3], "slot 10 zero-filled; restart the daemon")
    finally:
        ledger.close()
    ((event_id,),) = query(path, "SELECT event_id FROM events WHERE kind = 'content_dirty'")
    execute(path, f"UPDATE events SET reason = 'nothing wrong' WHERE event_id = {event_id}")
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert f"chain: INCONSISTENT: event #{event_id}'s chain value does not follow" in out, out


# --- identical refusals are counted, refusals with another reason are not ------------------------


def test_consecutive_refusals_share_a_row_only_when_their_reason_is_the_same_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = open_ledger(tmp_path / "l.sqlite")
    try:
        record = start(ledger)
        for reason in ("engine-b is attached", "engine-c is attached", "engine-c is attached"):
            record.record_refusal("begin", "engine-a", reason, busy=True)
        with contextlib.suppress(errors.RequestRefused):
            record.begin("intruder", 0, [1])
        with contextlib.suppress(errors.RequestRefused):
            record.begin("intruder", 0, [1])
    finally:
        ledger.close()
    rows = query(
        ledger.path,
        "SELECT kind, engine_id, reason, count FROM events WHERE kind LIKE 'begin_%' "
        "ORDER BY event_id",
    )
    assert [(kind, engine, count) for kind, engine, _, count in rows] == [
        ("begin_busy", "engine-a", 1),
        ("begin_busy", "engine-a", 2),
        ("begin_refused", "intruder", 2),
    ]
    assert [reason for _, _, reason, _ in rows[:2]] == [
        "engine-b is attached",
        "engine-c is attached",
    ]
    code, out, _ = run_cli(capsys, "verify", str(ledger.path))
    assert code == exit_codes.OK, out


# --- no one else's companion file is read, the group's neither ------------------------------------


def _closed_ledger(tmp_path: Path) -> Path:
    path = tmp_path / "l.sqlite"
    start(ledger := open_ledger(path))
    ledger.close()
    return path


@pytest.mark.parametrize(
    "mode", [0o620, 0o660, 0o670, 0o602, 0o622], ids=lambda mode: f"{mode:04o}"
)
@pytest.mark.parametrize("suffix", COMPANION_SUFFIXES)
def test_a_companion_the_group_or_others_may_write_is_refused_before_sqlite_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str, mode: int
) -> None:
    path = _closed_ledger(tmp_path)
    crafted = path.with_name(path.name + suffix)
    crafted.write_bytes(b"")
    os.chmod(crafted, mode)
    expected = f"{crafted} has mode {mode:04o}: others may write it"
    with pytest.raises(LedgerFileError, match=expected.replace(".", r"\.")):
        check_companions(path, os.geteuid())
    with pytest.raises(LedgerFileError, match="others may write it"):
        LedgerReader(path)
    with pytest.raises(LedgerFileError, match="others may write it"):
        open_ledger(path)
    code, out, err = run_cli(capsys, "status", str(path))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert expected in err
    assert stat.S_IMODE(os.stat(crafted).st_mode) == mode  # refused, not "fixed"


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o644, 0o400], ids=lambda mode: f"{mode:04o}")
def test_a_companion_only_its_owner_may_write_is_read(tmp_path: Path, mode: int) -> None:
    path = _closed_ledger(tmp_path)
    lock = path.with_name(path.name + ".lock")
    lock.write_bytes(b"")
    os.chmod(lock, mode)
    check_companions(path, os.geteuid())
    with LedgerReader(path) as reader:
        assert reader.state().version == 0
