"""The schema is Alembic's: upgrade from empty and from every revision, down and back, no drift."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from ledger_support import SMALL, move, open_ledger, start
from sqlalchemy import create_engine

from layout_ledger.core.errors import SchemaOutdated, SchemaTooNew
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.migrate import alembic_config
from layout_ledger.store.schema import KNOWN_REVISIONS, SCHEMA_HEAD, metadata

ROOT = Path(__file__).resolve().parent.parent
VIEWS = {
    "ledger_incarnations",
    "ledger_events",
    "ledger_current_layout",
    "ledger_layout_history",
    "ledger_attachments",
    "ledger_slot_fingerprints",
    "ledger_checkpoints",
}


def _migrate(path: Path, action, revision: str) -> None:
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        action(alembic_config(conn), revision)
    engine.dispose()


def _objects(path: Path) -> dict[str, set[str]]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        found: dict[str, set[str]] = {}
        for kind, name in rows:
            found.setdefault(kind, set()).add(name)
    return found


def _revision(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def test_known_revisions_are_alembics_revision_chain_and_head():
    scripts = ScriptDirectory.from_config(alembic_config())
    chain = [rev.revision for rev in scripts.walk_revisions("base", "heads")]
    assert tuple(reversed(chain)) == KNOWN_REVISIONS
    assert scripts.get_current_head() == SCHEMA_HEAD


def test_opening_an_empty_path_upgrades_to_head_with_every_view(tmp_path):
    path = tmp_path / "l.sqlite"
    open_ledger(path).close()
    assert _revision(path) == SCHEMA_HEAD
    assert _objects(path)["view"] == VIEWS


@pytest.mark.parametrize("revision", KNOWN_REVISIONS[:-1])
def test_a_writer_upgrades_a_ledger_from_every_earlier_revision(tmp_path, revision):
    path = tmp_path / "l.sqlite"
    _migrate(path, command.upgrade, revision)
    assert _revision(path) == revision
    ledger = open_ledger(path)
    record = start(ledger)
    ledger.close()
    assert _revision(path) == SCHEMA_HEAD
    with LedgerReader(path) as reader:
        assert reader.state().incarnation_id == record.incarnation_id


@pytest.mark.parametrize("revision", KNOWN_REVISIONS[:-1])
def test_a_reader_refuses_an_older_ledger_and_says_to_upgrade(tmp_path, revision):
    path = tmp_path / "l.sqlite"
    _migrate(path, command.upgrade, revision)
    with pytest.raises(SchemaOutdated, match=f"run `layout-ledger upgrade {path}`"):
        LedgerReader(path)


def test_downgrade_to_base_and_back_keeps_a_working_ledger(tmp_path):
    path = tmp_path / "l.sqlite"
    open_ledger(path).close()
    _migrate(path, command.downgrade, "base")
    assert set(_objects(path).get("table", set())) == {"alembic_version"}
    assert "view" not in _objects(path)
    _migrate(path, command.upgrade, "head")
    ledger = open_ledger(path)
    import random

    record = start(ledger)
    record.attach("A")
    move(record, "A", [0], random.Random(0))
    ledger.close()
    with LedgerReader(path) as reader:
        assert reader.state().version == 1


def test_the_table_metadata_matches_the_migrated_schema(tmp_path):
    path = tmp_path / "l.sqlite"
    open_ledger(path).close()
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert diff == []


def test_a_ledger_newer_than_the_code_is_refused_by_writers_and_readers(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    start(ledger, SMALL)
    ledger.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
    message = (
        f"ledger {path} has schema revision '0099_from_the_future', newer than this code knows "
        f"(newest known: '{SCHEMA_HEAD}'); upgrade the sglang-expert-layout-ledger package"
    )
    with pytest.raises(SchemaTooNew) as writer_error:
        open_ledger(path)
    assert str(writer_error.value) == message
    with pytest.raises(SchemaTooNew) as reader_error:
        LedgerReader(path)
    assert str(reader_error.value) == message


def test_alembic_command_line_upgrades_a_ledger_from_a_clone(tmp_path):
    path = tmp_path / "cli.sqlite"
    alembic = Path(sys.executable).with_name("alembic")
    result = subprocess.run(
        [str(alembic), "-x", f"url=sqlite:///{path}", "upgrade", "head"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert _revision(path) == SCHEMA_HEAD
    assert _objects(path)["view"] == VIEWS


def test_an_install_ships_the_migrations_inside_the_ledger_package_not_as_a_top_level_package(
    tmp_path,
):
    """A wheel holds layout_ledger/migrations/ (env.py, the mako template, every revision) and no
    top-level ``migrations`` package; installed from it, the ledger creates and upgrades files."""
    import shutil
    import zipfile

    source = tmp_path / "source"  # setuptools writes build/ into the tree it builds
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "__pycache__")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [name for name in names if name.startswith("migrations/")]
    revisions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    for shipped in ["env.py", "script.py.mako", *[f"versions/{r}" for r in revisions]]:
        assert f"layout_ledger/migrations/{shipped}" in names
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    script = (
        "import sys, layout_ledger.store.migrate as m\n"
        "from layout_ledger.store.ledger import Ledger\n"
        "assert str(m.migrations_dir()).startswith(sys.argv[1]), m.migrations_dir()\n"
        "Ledger.open(sys.argv[2]).close()\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(target), str(tmp_path / "l.sqlite")],
        check=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    LedgerReader(tmp_path / "l.sqlite").close()  # opens only a ledger at the head revision


def _schema_sql(path: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' "
            "ORDER BY type, name"
        ).fetchall()


@pytest.mark.parametrize("revision", KNOWN_REVISIONS[:-1])
def test_downgrading_from_head_to_a_revision_restores_that_revisions_schema_exactly(
    tmp_path, revision
):
    path = tmp_path / "l.sqlite"
    _migrate(path, command.upgrade, revision)
    before = _schema_sql(path)
    _migrate(path, command.upgrade, "head")
    assert _schema_sql(path) != before
    _migrate(path, command.downgrade, revision)
    assert _schema_sql(path) == before
