"""The ledger file when people and other processes touch it: links, someone else's companion
files, loosened modes, the default directory, read-only media.

Bind mounts and read-only mounts are made for real in a private mount namespace
(``unshare -m``, which needs root, as CI and this project's machines run); without it those
tests are skipped and say why.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_ledgers import build, run_cli
from ledger_support import open_ledger, start
from test_ledger_storage import _hold_writer

from layout_ledger.cli import exit_codes
from layout_ledger.core.errors import LedgerFileError
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.files import ensure_private_directory

NOBODY = 65534


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(
    not _can_mount(), reason="needs root and unshare -m for a private mount namespace"
)


def _in_mount_namespace(mounts: str, python: str) -> subprocess.CompletedProcess[str]:
    """Run ``python`` (a script) after the shell ``mounts``, in a private mount namespace."""
    script = f"set -e\n{mounts}\nexec {sys.executable} -c {_quote(textwrap.dedent(python))}\n"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


# --- one writer per file, whatever names it --------------------------------------------------


def test_a_ledger_with_a_second_hard_link_is_refused_saying_why(tmp_path):
    path = tmp_path / "l.sqlite"
    start(ledger := open_ledger(path))
    ledger.close()
    os.link(path, tmp_path / "other-name.sqlite")
    for name in (path, tmp_path / "other-name.sqlite"):
        with pytest.raises(LedgerFileError) as info:
            open_ledger(name)
        assert "has 2 hard links" in str(info.value)
        assert "commits could be lost" in str(info.value)


def test_a_second_daemon_is_refused_when_a_hard_link_appears_after_the_first_started(tmp_path):
    path = tmp_path / "l.sqlite"
    holder = _hold_writer(path)
    try:
        os.link(path, tmp_path / "link.sqlite")
        with pytest.raises(LedgerFileError, match="has 2 hard links"):
            open_ledger(tmp_path / "link.sqlite")
    finally:
        holder.kill()
        holder.wait()


@needs_mounts
def test_a_second_daemon_on_a_bind_mount_of_the_same_file_is_refused(tmp_path):
    path = tmp_path / "l.sqlite"
    other = tmp_path / "elsewhere"
    other.mkdir()
    bound = other / "bound.sqlite"
    bound.touch()
    holder = _hold_writer(path)
    try:
        result = _in_mount_namespace(
            f"mount --bind {path} {bound}",
            f"""
            from layout_ledger.core.errors import LedgerLocked
            from layout_ledger.store.ledger import Ledger
            try:
                Ledger.open({str(bound)!r})
            except LedgerLocked as exc:
                print("refused:", exc)
            else:
                print("opened")
            """,
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.stdout.startswith(f"refused: ledger {bound} is owned by another daemon"), (
        result.stdout + result.stderr
    )


# --- someone else's -wal, -shm, -journal or .lock is never read ------------------------------


def _closed_ledger(tmp_path: Path) -> Path:
    path = tmp_path / "l.sqlite"
    start(ledger := open_ledger(path))
    ledger.close()
    return path


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal", ".lock"])
def test_a_companion_file_of_another_user_is_refused_before_sqlite_opens_anything(
    tmp_path, capsys, suffix
):
    path = _closed_ledger(tmp_path)
    crafted = path.with_name(path.name + suffix)
    crafted.write_bytes(b"crafted by someone else")
    os.chown(crafted, NOBODY, NOBODY)
    os.chmod(crafted, 0o644)
    expected = f"{crafted} is owned by uid {NOBODY}, not by the ledger's owner"
    with pytest.raises(LedgerFileError, match=expected.replace(".", r"\.")):
        open_ledger(path)
    code, out, err = run_cli(capsys, "status", str(path))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert expected in err
    assert crafted.read_bytes() == b"crafted by someone else"


def test_a_companion_file_others_may_write_is_refused(tmp_path, capsys):
    path = _closed_ledger(tmp_path)
    crafted = path.with_name(path.name + "-wal")
    crafted.write_bytes(b"")
    os.chmod(crafted, 0o666)
    code, _, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.UNUSABLE
    assert f"{crafted} has mode 0666: others may write it" in err
    with pytest.raises(LedgerFileError, match="others may write it"):
        open_ledger(path)
    assert stat.S_IMODE(os.stat(crafted).st_mode) == 0o666  # refused, not "fixed"


def test_a_companion_symlink_is_refused(tmp_path):
    path = _closed_ledger(tmp_path)
    (tmp_path / "target").write_bytes(b"")
    os.symlink(tmp_path / "target", path.with_name(path.name + "-shm"))
    with pytest.raises(LedgerFileError, match="-shm is a symbolic link"):
        LedgerReader(path)


# --- modes are enforced --------------------------------------------------------------------


def test_the_daemon_tightens_a_loose_ledger_and_its_companions_to_0600_with_one_warning(
    tmp_path, caplog
):
    path = _closed_ledger(tmp_path)
    os.chmod(path, 0o644)
    wal = path.with_name(path.name + "-wal")
    wal.write_bytes(b"")
    os.chmod(wal, 0o644)
    with caplog.at_level(logging.WARNING, logger="layout_ledger.store.files"):
        ledger = open_ledger(path)
    try:
        start(ledger)
        for file in [path, *tmp_path.glob("l.sqlite?*")]:
            assert stat.S_IMODE(os.stat(file).st_mode) == 0o600, file
    finally:
        ledger.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "layout_ledger.store.files"]
    assert "l.sqlite was 0644" in warning and "l.sqlite-wal was 0644" in warning


def test_a_ledger_others_may_write_is_refused_until_checked(tmp_path):
    path = _closed_ledger(tmp_path)
    os.chmod(path, 0o666)
    with pytest.raises(LedgerFileError, match="has mode 0666: others may have written it"):
        open_ledger(path)


# --- the default directory is private ------------------------------------------------------


def test_the_default_ledger_directory_is_created_private(tmp_path):
    directory = tmp_path / "ledgers"
    old = os.umask(0)
    try:
        ensure_private_directory(directory)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    ensure_private_directory(directory)  # again: ours and private, accepted


@pytest.mark.parametrize(
    ("owner", "mode", "message"),
    [(NOBODY, 0o700, "belongs to uid 65534"), (None, 0o755, "has mode 0755; it must be 0700")],
    ids=["someone else's", "loosened"],
)
def test_a_default_ledger_directory_that_is_not_private_is_refused(tmp_path, owner, mode, message):
    directory = tmp_path / "ledgers"
    directory.mkdir()
    os.chmod(directory, mode)
    if owner is not None:
        os.chown(directory, owner, owner)
    with pytest.raises(LedgerFileError, match=message):
        ensure_private_directory(directory)


# --- read-only media -----------------------------------------------------------------------


def _evidence_copy(tmp_path: Path, with_wal: bool) -> Path:
    """A killed daemon's ledger (its commits still in the -wal), copied to an evidence folder."""
    (tmp_path / "built").mkdir()
    built = build("clean", tmp_path / "built" / "l.sqlite")
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    shutil.copyfile(built, evidence / "l.sqlite")
    wal = built.with_name("l.sqlite-wal")
    if with_wal:
        assert wal.stat().st_size > 0
        shutil.copyfile(wal, evidence / "l.sqlite-wal")
    else:
        with sqlite3.connect(built) as conn:  # fold the WAL in first, as a clean shutdown does
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        shutil.copyfile(built, evidence / "l.sqlite")
    return evidence / "l.sqlite"


@needs_mounts
@pytest.mark.parametrize("with_wal", [False, True], ids=["no -wal", "with -wal content"])
def test_read_commands_work_on_a_ledger_on_read_only_media(tmp_path, with_wal):
    path = _evidence_copy(tmp_path, with_wal)
    folder = path.parent
    before = sorted(p.name for p in folder.iterdir())
    result = _in_mount_namespace(
        f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder}",
        f"""
        import sys
        from layout_ledger.cli.app import main
        for command in (["status"], ["verify"], ["history", "--last", "1"], ["show"]):
            code = main([command[0], {str(path)!r}, *command[1:]])
            print("exit", command[0], code, flush=True)
        """,
    )
    assert result.returncode == 0, result.stderr
    exits = [line for line in result.stdout.splitlines() if line.startswith("exit ")]
    # status: 6, the evidence copy's daemon does not run (its writer lock is free)
    assert exits == ["exit status 6", "exit verify 0", "exit history 0", "exit show 0"], (
        result.stdout + result.stderr
    )
    assert "incarnation:         2 of 2" in result.stdout
    assert "version:             3\n" in result.stdout
    assert sorted(p.name for p in folder.iterdir()) == before
