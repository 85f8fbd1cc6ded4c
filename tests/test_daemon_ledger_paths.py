"""Where a daemon's ledger lives and how much it keeps: template, env var, launcher flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import pytest

from layout_ledger.store.retention import Retention
from sglang_integration import settings
from sglang_integration.daemon import ledger_paths
from sglang_integration.daemon.record_opening import daemon_retention
from sglang_integration.settings import (
    DEFAULT_KEEP_VERSIONS,
    DEFAULT_PRUNE_EVERY,
    KEEP_VERSIONS,
    LEDGER_TEMPLATE,
    PRUNE_EVERY,
    REQUEST_TIMEOUT,
    SettingError,
    add_daemon_flags,
    export_daemon_flags,
)

SOCKET_ENV = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"


NAMES = (SOCKET_ENV, "XDG_STATE_HOME", *(setting.env for setting in settings.SETTINGS))


@pytest.fixture(autouse=True)
def clean_env() -> Iterator[None]:
    """None of the settings set; whatever a test (or export_daemon_flags) sets is undone."""
    saved = {name: os.environ.pop(name, None) for name in NAMES}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def test_a_root_daemons_default_ledger_survives_a_reboot_under_var_lib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("XDG_STATE_HOME", "/home/x/.state")  # not a root daemon's
    assert ledger_paths.ledger_path("GPU-1234") == (
        "/var/lib/sglang/expert_layouts/expert_layout_GPU-1234.sqlite"
    )


def test_another_users_default_ledger_lies_in_its_xdg_state_home(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", "/home/op")
    assert ledger_paths.ledger_path("GPU-9") == (
        "/home/op/.local/state/sglang/expert_layouts/expert_layout_GPU-9.sqlite"
    )
    monkeypatch.setenv("XDG_STATE_HOME", "/srv/state")
    assert ledger_paths.ledger_path("GPU-9") == (
        "/srv/state/sglang/expert_layouts/expert_layout_GPU-9.sqlite"
    )
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # XDG: a relative one is ignored
    assert ledger_paths.ledger_path("GPU-9").startswith("/home/op/.local/state/")


@pytest.mark.parametrize("euid", [0, 1000])
def test_the_default_ledger_is_never_under_tmp_even_when_the_sockets_are(
    monkeypatch: pytest.MonkeyPatch, euid: int
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setenv("HOME", "/home/op")
    for sockets in ("/tmp/sglang_weight_cache_{device_uuid}.sock", "/run/wc/{device_uuid}.sock"):
        monkeypatch.setenv(SOCKET_ENV, sockets)  # sglang's default, and a moved one
        assert not ledger_paths.ledger_path("GPU-9").startswith(("/tmp/", "/run/"))


def test_the_env_var_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOCKET_ENV, "/run/wc/{device_uuid}.sock")
    monkeypatch.setenv(LEDGER_TEMPLATE.env, "/var/lib/ledgers/{device_uuid}.db")
    assert ledger_paths.ledger_path("GPU-9") == "/var/lib/ledgers/GPU-9.db"


def test_the_launcher_flag_overrides_the_env_var_for_this_process_and_its_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LEDGER_TEMPLATE.env, "/from/env/{device_uuid}.db")
    parser = argparse.ArgumentParser()
    add_daemon_flags(parser)
    args, rest = parser.parse_known_args(
        [
            "--model-path",
            "m",
            "--expert-layout-ledger",
            "/from/flag/{device_uuid}.db",
            "--expert-layout-keep-versions",
            "7",
            "--expert-layout-prune-every",
            "3",
        ]
    )
    assert rest == ["--model-path", "m"]  # everything else goes to sglang's parser
    export_daemon_flags(args)
    assert ledger_paths.ledger_path("GPU-1") == "/from/flag/GPU-1.db"
    assert daemon_retention() == Retention(keep_versions=7, prune_every=3)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("/var/lib/ledger.sqlite", "must contain '{device_uuid}'"),
        ("/var/{gpu}/{device_uuid}.db", "placeholder other than"),
        ("/var/{0}/{device_uuid}.db", "placeholder other than"),
    ],
)
def test_a_template_without_the_device_placeholder_or_with_another_is_refused(
    template: str, why: str
) -> None:
    with pytest.raises(SettingError, match=why.replace("{", r"\{").replace("}", r"\}")):
        ledger_paths.ledger_path("GPU-1", template)
    with pytest.raises(SettingError):
        LEDGER_TEMPLATE.export(template)


def test_retention_defaults_to_the_settings_and_rejects_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert daemon_retention() == Retention(
        keep_versions=DEFAULT_KEEP_VERSIONS, prune_every=DEFAULT_PRUNE_EVERY
    )
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(KEEP_VERSIONS.env, bad)
        with pytest.raises(SettingError, match=KEEP_VERSIONS.env):
            daemon_retention()
    with pytest.raises(SettingError):
        PRUNE_EVERY.export("0")


def test_the_request_timeout_is_5_s_unless_the_launcher_flag_or_env_var_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert REQUEST_TIMEOUT.read() == 5.0
    monkeypatch.setenv(REQUEST_TIMEOUT.env, "2.5")
    assert REQUEST_TIMEOUT.read() == 2.5
    parser = argparse.ArgumentParser()
    add_daemon_flags(parser)
    args, _ = parser.parse_known_args(["--expert-layout-request-timeout", "0.75"])
    export_daemon_flags(args)
    assert os.environ[REQUEST_TIMEOUT.env] == "0.75"  # what spawned daemons read
    assert REQUEST_TIMEOUT.read() == 0.75
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(REQUEST_TIMEOUT.env, bad)
        with pytest.raises(SettingError, match=REQUEST_TIMEOUT.env):
            REQUEST_TIMEOUT.read()
    with pytest.raises(SettingError):
        REQUEST_TIMEOUT.export("0.0")


def test_the_launcher_refuses_a_bad_ledger_template_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sglang_integration.daemon.launcher import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", "m", "--expert-layout-ledger", "/var/lib/one-ledger.sqlite"])
    assert exit_info.value.code == 2
    assert "must contain '{device_uuid}'" in capsys.readouterr().err
    assert LEDGER_TEMPLATE.env not in os.environ


def test_the_daemon_makes_the_default_ledger_directory_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import stat

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", f"{tmp_path}/state")  # missing: made 0700 too
    path = ledger_paths.prepare_ledger_path("GPU-7")
    assert path == f"{tmp_path}/state/sglang/expert_layouts/expert_layout_GPU-7.sqlite"
    for directory in ("state", "state/sglang", "state/sglang/expert_layouts"):
        assert stat.S_IMODE(os.stat(tmp_path / directory).st_mode) == 0o700, directory
    monkeypatch.setenv(LEDGER_TEMPLATE.env, f"{tmp_path}/mine/{{device_uuid}}.db")
    assert ledger_paths.prepare_ledger_path("GPU-7") == f"{tmp_path}/mine/GPU-7.db"
    assert not (tmp_path / "mine").exists()  # a chosen location is the operator's to prepare
