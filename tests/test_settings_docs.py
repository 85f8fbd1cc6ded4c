"""The settings module and the settings tables of the docs hold the same rows.

docs/daemon.md lists the daemon's settings (those with a launcher flag), docs/design.md "The
engine side" those only an engine reads: each row of ``sglang_integration.settings.SETTINGS`` is
in one of the two tables with the same flag, environment variable and default, and neither has
another row. The README has no settings table (it names a few settings, which
tests/test_readme.py checks against this module).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_integration import settings

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ONLY = "(engine)"  # the flag cell of a setting only the environment sets


def _table(path: Path, section: str) -> list[list[str]]:
    """The cells of the first settings table (header ``| setting | flag ...``) in ``section``."""
    text = path.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    lines = text[start : end if end != -1 else None].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| setting | flag"))
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def _documented(rows: list[list[str]]) -> dict[str, tuple[str | None, str]]:
    """env var -> (flag or None, default) as the table writes them."""
    found: dict[str, tuple[str | None, str]] = {}
    for _, flag, env, default in rows:
        (name,) = re.findall(r"^`([A-Z_]+)`", env)
        found[name] = (
            None if flag == ENGINE_ONLY else flag.strip("`"),
            default.replace("`", "").split()[0],
        )
    return found


def _module(rows: tuple[settings.Setting[object], ...]) -> dict[str, tuple[str | None, str]]:
    """env var -> (flag, the default's first word, as a table cell starts)."""
    return {setting.env: (setting.flag, setting.default_text.split()[0]) for setting in rows}


def test_the_engine_docs_settings_table_is_the_settings_only_an_engine_reads() -> None:
    rows = _table(ROOT / "docs" / "design.md", "The engine side")
    engine_rows = tuple(setting for setting in settings.SETTINGS if setting.flag is None)
    assert _documented(rows) == _module(engine_rows)
    assert len(rows) == len(engine_rows)


def test_the_daemon_docs_settings_table_is_the_daemons_settings() -> None:
    rows = _table(ROOT / "docs" / "daemon.md", "Running a daemon with the ledger")
    daemon_rows = tuple(setting for _, setting in settings.DAEMON_FLAGS)
    assert _documented(rows) == _module(daemon_rows)
    assert len(rows) == len(daemon_rows)


@pytest.mark.parametrize("setting", settings.SETTINGS, ids=lambda setting: setting.env)
def test_every_setting_reads_its_default_when_unset_and_names_itself_when_wrong(
    setting: settings.Setting[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(setting.env, raising=False)
    assert setting.read() == setting.default
    monkeypatch.setenv(setting.env, "-1 {nonsense")
    with pytest.raises(settings.SettingError, match=re.escape(setting.env)):
        setting.read()


def test_the_launcher_help_names_every_flag_its_variable_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    monkeypatch.setenv("COLUMNS", "400")  # no line break inside a long default
    parser = argparse.ArgumentParser()
    settings.add_daemon_flags(parser)
    text = " ".join(parser.format_help().split())
    for flag, setting in settings.DAEMON_FLAGS:
        assert flag in text
        assert f"(env {setting.env}; default {setting.default_text})" in text


def test_the_cli_names_the_engines_wait_timeout_as_the_settings_do() -> None:
    # The CLI cannot import the plugin; it repeats the variable's name, and must repeat it right.
    from layout_ledger.cli.commands import fleet

    assert settings.WAIT_TIMEOUT.env == fleet.WAIT_TIMEOUT_ENV
