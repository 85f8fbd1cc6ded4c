"""``layout-ledger plot``: a PNG that opens, of the size asked, and moves counted from the rows."""

from __future__ import annotations

import json

import pytest
from cli_ledgers import MOVES, build, map_after, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.diff import collect_diff
from layout_ledger.core.layout import layout_digest
from layout_ledger.history.reader import LedgerReader

matplotlib_image = pytest.importorskip("matplotlib.image", reason="plot needs the [plot] extra")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return build("clean", tmp_path_factory.mktemp("plot") / "clean.sqlite")


def _pixels(path) -> tuple[int, int]:
    image = matplotlib_image.imread(path)
    height, width = image.shape[:2]
    return width, height


def test_plot_writes_a_png_of_the_default_size(clean, tmp_path, capsys):
    output = tmp_path / "layout.png"
    code, out, err = run_cli(capsys, "plot", str(clean), "-o", str(output), "--ep-size", "2")
    assert (code, err) == (exit_codes.OK, "")
    assert out == (
        f"wrote {output} (1200x800): incarnation 2 version 3 (digest "
        f"{layout_digest(map_after(MOVES, 3))[:12]}), ep_size 2\n"
    )
    assert output.read_bytes().startswith(PNG_SIGNATURE)
    assert _pixels(output) == (1200, 800)


def test_plot_with_moves_at_another_size_counts_the_slots_each_commit_moved(
    clean, tmp_path, capsys
):
    output = tmp_path / "moves.png"
    argv = ["plot", str(clean), "-o", str(output), "--moves", "--size", "900x700", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == exit_codes.OK
    assert _pixels(output) == (900, 700)
    report = json.loads(out)
    assert (report["width"], report["height"], report["version"]) == (900, 700, 3)
    with LedgerReader(clean) as reader:
        expected = [
            collect_diff(reader, version - 1, version, incarnation_id=2).changed_slots
            for version in (1, 2, 3)
        ]
    assert [move["moved_slots"] for move in report["moves"]] == expected == [4, 4, 6]
    assert [move["version"] for move in report["moves"]] == [1, 2, 3]


def test_plot_of_an_older_version_and_incarnation(clean, tmp_path, capsys):
    output = tmp_path / "first.png"
    argv = ["plot", str(clean), "-o", str(output), "--incarnation", "1", "--version", "0"]
    argv += ["--moves", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == exit_codes.OK
    report = json.loads(out)
    assert (report["incarnation_id"], report["version"], report["moves"]) == (1, 0, [])
    assert _pixels(output) == (1200, 800)


def test_plot_refuses_an_ep_size_that_does_not_divide_the_slots(clean, tmp_path, capsys):
    output = tmp_path / "bad.png"
    code, out, err = run_cli(capsys, "plot", str(clean), "-o", str(output), "--ep-size", "4")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        "layout-ledger plot: error: --ep-size 4 does not divide the 6 physical slots per layer; "
        "pass the EP size the engines run with\n"
    )
    assert not output.exists()


def test_plot_into_a_missing_directory_fails_in_one_line(clean, tmp_path, capsys):
    output = tmp_path / "no" / "such" / "dir.png"
    code, _, err = run_cli(capsys, "plot", str(clean), "-o", str(output))
    assert code == exit_codes.FAILED
    assert err == (
        f"layout-ledger plot: error: cannot write {output}: the directory {output.parent} does "
        f"not exist; create it, or name a file in an existing directory\n"
    )


@pytest.mark.parametrize(
    ("suffix", "signature"),
    [(".svg", b"<?xml"), (".pdf", b"%PDF-"), (".PNG", PNG_SIGNATURE)],
)
def test_plot_writes_the_format_its_suffix_names(clean, tmp_path, capsys, suffix, signature):
    output = tmp_path / f"layout{suffix}"
    code, out, err = run_cli(capsys, "plot", str(clean), "-o", str(output))
    assert (code, err) == (exit_codes.OK, "")
    assert out.startswith(f"wrote {output} (1200x800): ")
    assert output.read_bytes().startswith(signature)


def test_plot_refuses_a_suffix_it_cannot_write_naming_the_accepted_ones(clean, tmp_path, capsys):
    output = tmp_path / "layout.jpg"
    code, out, err = run_cli(capsys, "plot", str(clean), "-o", str(output))
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger plot: error: name the picture *.png, *.svg or *.pdf (got {output}): plot "
        "writes the format its suffix names\n"
    )
    assert not output.exists()
