"""The command line's options: what each accepts, what it refuses, and what its help says."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from cli_ledgers import build, execute, run_cli
from test_cli_read import clean_history

import layout_ledger
from layout_ledger.cli import exit_codes, time_text
from layout_ledger.cli import parser as cli
from layout_ledger.core.errors import LedgerError


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("clean", tmp_path_factory.mktemp("arguments") / "clean.sqlite")


def _event_ids(out: str) -> list[int]:
    expected = clean_history()
    return [expected.index(line) + 1 for line in out.splitlines()]


# --- --layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["history", "show", "diff"])
def test_a_layer_range_beyond_the_ledgers_layers_is_one_error_line_and_exit_1(
    clean, capsys, command
):
    argv = [command, str(clean), "--layers", "2,0-1000000000"]
    if command == "diff":
        argv += ["0", "1"]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger {command}: error: layers 4-1000000000 do not exist: this ledger's maps "
        "have layers 0..3\n"
    )


def test_a_single_layer_beyond_the_ledger_is_named_in_history_too(clean, capsys):
    code, _, err = run_cli(capsys, "history", str(clean), "--layers", "1,7")
    assert code == exit_codes.FAILED
    assert err == (
        "layout-ledger history: error: layer 7 does not exist: this ledger's maps have layers "
        "0..3\n"
    )


def test_the_layers_argument_keeps_ranges_unexpanded_until_the_geometry_is_known():
    args = cli.parse(["history", "L", "--layers", "3,0-100000000,5-7"])
    assert args.layers.ranges == ((0, 100000000), (3, 3), (5, 7))
    with pytest.raises(LedgerError, match=r"^layers 10-100000000 do not exist: "):
        args.layers.expand(10)
    assert cli.parse(["show", "L", "--layers", "5-7,3,0-1,6"]).layers.expand(10) == (
        0,
        1,
        3,
        5,
        6,
        7,
    )


# --- --incarnation ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "0"])
def test_an_incarnation_below_1_gets_one_message(capsys, value):
    code, _, err = run_cli(capsys, "status", "L", "--incarnation", value)
    assert code == exit_codes.UNUSABLE
    assert f"argument --incarnation: expected a number >= 1, got {value} " in err


@pytest.mark.parametrize(
    ("command", "default"),
    [
        ("history", "default: all incarnations"),
        ("prune", "default: all incarnations"),
        ("status", "default: the latest"),
        ("show", "default: the latest"),
        ("diff", "default: the latest"),
        ("export", "default: the latest"),
        ("plot", "default: the latest"),
    ],
)
def test_the_incarnation_help_names_the_default_the_command_uses(capsys, command, default):
    _, out, _ = run_cli(capsys, command, "--help")
    help_text = " ".join(out.split())
    start = help_text.rindex("--incarnation N")
    assert default in help_text[start : start + 120]


def test_history_and_prune_without_incarnation_cover_every_incarnation(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    _, out, _ = run_cli(capsys, "history", str(path), "--kind", "start", "--json")
    assert [event["incarnation_id"] for event in json.loads(out)["events"]] == [1, 2]
    _, out, _ = run_cli(capsys, "prune", str(path), "--keep", "1", "--json")
    assert [inc["incarnation_id"] for inc in json.loads(out)["incarnations"]] == [1, 2]


# --- --since / --until --------------------------------------------------------------------


class _Python310Datetime(datetime.datetime):
    """``datetime.fromisoformat`` as Python 3.10 has it: no trailing ``Z``."""

    @classmethod
    def fromisoformat(cls, date_string: str) -> _Python310Datetime:
        if date_string.endswith(("Z", "z")):
            raise ValueError(f"Invalid isoformat string: {date_string!r}")
        return super().fromisoformat(date_string)


@pytest.mark.parametrize("value", ["2026-01-01T00:00:15Z", "2026-01-01T00:00:15z"])
def test_since_accepts_a_trailing_z_on_every_python(clean, capsys, monkeypatch, value):
    stand_in = types.SimpleNamespace(
        datetime=_Python310Datetime, timezone=datetime.timezone, timedelta=datetime.timedelta
    )
    monkeypatch.setattr(time_text, "datetime", stand_in)
    code, out, err = run_cli(capsys, "history", str(clean), "--since", value)
    assert (code, err) == (exit_codes.OK, "")
    assert _event_ids(out) == [16, 17]


# --- --kind and --engine ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kinds", "event_ids"),
    [
        (["--kind", "commit,abort"], [8, 10, 15, 17]),
        (["--kind", "commit, abort", "--kind", "begin_busy"], [8, 10, 12, 15, 17]),
        (["--kind", "abort,abort"], [15]),
    ],
)
def test_kind_takes_comma_lists_and_repeats(clean, capsys, kinds, event_ids):
    code, out, _ = run_cli(capsys, "history", str(clean), *kinds)
    assert code == exit_codes.OK
    assert _event_ids(out) == event_ids


def test_kind_refuses_an_unknown_kind_inside_a_list(capsys):
    code, _, err = run_cli(capsys, "history", "L", "--kind", "commit,explode")
    assert code == exit_codes.UNUSABLE
    assert "argument --kind: invalid choice: 'explode' (choose from start, end," in err


def test_engine_takes_a_unique_prefix_of_an_engine_id(clean, capsys):
    code, out, _ = run_cli(capsys, "history", str(clean), "--engine", "engine-o")
    assert code == exit_codes.OK
    assert _event_ids(out) == [2, 3]
    _, out, _ = run_cli(capsys, "history", str(clean), "--engine", "engine-o", "--json")
    assert json.loads(out)["filter"]["engine_id"] == "engine-old"


def test_engine_with_an_ambiguous_prefix_is_an_error_listing_the_matches(clean, capsys):
    code, out, err = run_cli(capsys, "history", str(clean), "--engine", "engine-")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        "layout-ledger history: error: --engine 'engine-' matches 3 engines: 'engine-a', "
        "'engine-b', 'engine-old'; give more of the id\n"
    )


def test_an_exact_engine_id_wins_over_longer_ids_it_prefixes(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE events SET engine_id = 'engine-ab' WHERE engine_id = 'engine-b'")
    code, out, _ = run_cli(capsys, "history", str(path), "--engine", "engine-a", "--kind", "attach")
    assert code == exit_codes.OK
    assert [line.split()[4] for line in out.splitlines()] == ["engine=engine-a"]


# --- --nl and --csv -----------------------------------------------------------------------


def test_history_nl_prints_one_json_event_per_line(clean, capsys):
    _, whole, _ = run_cli(capsys, "history", str(clean), "--json")
    code, out, _ = run_cli(capsys, "history", str(clean), "--nl")
    assert code == exit_codes.OK
    assert [json.loads(line) for line in out.splitlines()] == json.loads(whole)["events"]
    assert list(json.loads(out.splitlines()[0])) == [
        "ledger",
        "rank",
        "event_id",
        "incarnation_id",
        "at",
        "kind",
        "engine_id",
        "layers",
        "base_version",
        "new_version",
        "digest_after",
        "reason",
        "count",
        "last_at",
        "chain",
    ]


def test_history_csv_prints_a_header_and_one_row_per_event(clean, capsys):
    _, whole, _ = run_cli(capsys, "history", str(clean), "--kind", "commit", "--json")
    code, out, _ = run_cli(capsys, "history", str(clean), "--kind", "commit", "--csv")
    assert code == exit_codes.OK
    rows = list(csv.DictReader(io.StringIO(out)))
    events = json.loads(whole)["events"]
    assert len(rows) == len(events) == 3
    for row, event in zip(rows, events, strict=True):
        assert row["event_id"] == str(event["event_id"])
        assert row["layers"] == json.dumps(event["layers"])
        assert row["engine_id"] == event["engine_id"]
        assert row["reason"] == ""


def test_history_with_no_match_prints_only_the_csv_header_and_no_nl_line(clean, capsys):
    _, out, _ = run_cli(capsys, "history", str(clean), "--engine", "nobody", "--csv")
    assert out == (
        "ledger,rank,event_id,incarnation_id,at,kind,engine_id,layers,base_version,new_version,"
        "digest_after,reason,count,last_at,chain\r\n"
    )
    _, out, _ = run_cli(capsys, "history", str(clean), "--engine", "nobody", "--nl")
    assert out == ""


def test_diff_rows_are_the_changed_slots(clean, capsys):
    code, out, _ = run_cli(capsys, "diff", str(clean), "2", "3", "--csv")
    assert code == exit_codes.OK
    assert out.splitlines() == [
        "layer,slot,from,to",
        "0,4,0,1",
        "0,5,1,0",
        "3,0,0,2",
        "3,1,1,3",
        "3,2,2,0",
        "3,3,3,1",
    ]
    _, out, _ = run_cli(capsys, "diff", str(clean), "2", "3", "--nl")
    assert json.loads(out.splitlines()[0]) == {"layer": 0, "slot": 4, "from": 0, "to": 1}


@pytest.mark.parametrize("forms", [["--json", "--nl"], ["--json", "--csv"], ["--nl", "--csv"]])
def test_the_row_forms_and_json_exclude_each_other(capsys, forms):
    code, out, err = run_cli(capsys, "history", "L", *forms)
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert "not allowed with argument" in err


# --- --version ----------------------------------------------------------------------------


def test_version_prints_the_tools_own_version(capsys):
    code, out, err = run_cli(capsys, "--version")
    assert (code, err) == (exit_codes.OK, "")
    assert out == f"layout-ledger {importlib.metadata.version('sglang-expert-layout-ledger')}\n"


def test_the_packages_version_is_the_distributions():
    assert layout_ledger.__version__ == importlib.metadata.version("sglang-expert-layout-ledger")


def _loaded_by(prefixes: tuple[str, ...], *argv: str) -> list[str]:
    """The modules named ``prefixes*`` a fresh interpreter holds after ``layout-ledger ARGV``."""
    code = (
        "import contextlib, io, json, sys\n"
        "from layout_ledger.cli.app import main\n"
        "quiet = io.StringIO()\n"
        "with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):\n"
        "    main(sys.argv[1:])\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
    )
    return list(json.loads(done.stdout))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"], ["nope"]])
def test_version_help_and_a_usage_error_import_no_verb_and_no_sqlalchemy(argv):
    assert _loaded_by(("sqlalchemy", "layout_ledger.cli.commands."), *argv) == []


def test_a_verb_imports_its_own_module_and_no_other_verb(tmp_path):
    missing = str(tmp_path / "missing.sqlite")
    assert _loaded_by(("layout_ledger.cli.commands.",), "verify", missing) == [
        "layout_ledger.cli.commands.verify"
    ]


def test_a_subcommands_version_option_still_names_a_ledger_version(clean, capsys):
    code, out, _ = run_cli(capsys, "show", str(clean), "--version", "0", "--json")
    assert code == exit_codes.OK
    assert json.loads(out)["version"] == 0
