"""The CLI against sglang itself, each in a subprocess (``import sglang`` changes os.environ).

- ``show`` prints exactly what sglang's ``format_expert_location_layout`` prints for the map;
- ``export --check`` loads the exported file through sglang's own
  ``compute_initial_expert_location_metadata`` with real ServerArgs on the CPU (a tiny Qwen3-MoE
  ``config.json``, no weights) and fails when the model or the map does not match;
- no other command imports sglang or torch.

One subprocess does all of the sglang work (its import is most of the cost).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cli_ledgers import MOVES, build, map_after, run_cli
from test_updater_shared_experts import write_tiny_moe_config

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.show import format_physical_to_logical_map
from layout_ledger.history.reader import LedgerReader
from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

rng = random.Random(5)
RANDOM_MAP = [[rng.randrange(16) for _ in range(24)] for _ in range(5)]
# (map, ep_size, layer_ids): whole maps, subsets, ep sizes that do and do not divide the slots.
FORMAT_CASES: list[tuple[list[list[int]], int, list[int] | None]] = [
    (map_after(MOVES, 3), 1, None),
    (map_after(MOVES, 3), 2, None),
    (map_after(MOVES, 3), 3, [3, 1]),
    (map_after(MOVES, 3), 4, None),
    (RANDOM_MAP, 4, None),
    (RANDOM_MAP, 8, [0, 4]),
    (RANDOM_MAP, 5, [2]),
]

SGLANG_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from types import SimpleNamespace

    work = json.loads(sys.argv[1])
    results = {"formats": []}

    import torch
    from sglang.srt.eplb.expert_location import format_expert_location_layout

    for the_map, ep_size, layer_ids in work["formats"]:
        # format_expert_location_layout reads only these two attributes of the metadata.
        metadata = SimpleNamespace(
            physical_to_logical_map_cpu=torch.tensor(the_map), ep_size=ep_size
        )
        results["formats"].append(format_expert_location_layout(metadata, layer_ids))

    from layout_ledger.cli.app import main

    def run(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

    results["check"] = run(work["check"])
    results["wrong_model"] = run(work["wrong_model"])
    for name in ("existing", "forced"):
        results[name] = run(work[name])
        results[name]["file"] = open(work["existing_file"]).read()

    from layout_ledger.core.layout import Geometry
    from layout_ledger.cli.sglang_export_check import check_export

    tampered = json.loads(open(work["exported"]).read())["physical_to_logical_map"]
    tampered[2][5] = (tampered[2][5] + 1) % 4
    results["tampered"] = check_export(
        work["exported"], work["model"], tampered, Geometry(4, 6, 4), ep_size=2
    ).to_json()
    with open(work["results"], "w") as handle:
        json.dump(results, handle)
    """
)


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("sglang")
    ledger = build("clean", directory / "clean.sqlite")
    model = write_tiny_moe_config(directory / "model", num_layers=4, num_experts=4)
    other_model = write_tiny_moe_config(directory / "model-5-layers", num_layers=5, num_experts=4)
    exported = directory / "layout.json"
    existing = directory / "existing.json"
    existing.write_text("an operator's file\n")
    work = {
        "formats": FORMAT_CASES,
        "check": [
            "export", str(ledger), "-o", str(exported), "--check", "--model-path", str(model),
            "--ep-size", "2", "--json",
        ],
        "wrong_model": [
            "export", str(ledger), "-o", str(directory / "again.json"), "--check",
            "--model-path", str(other_model),
        ],
        "existing": [
            "export", str(ledger), "-o", str(existing), "--check", "--model-path", str(model),
            "--ep-size", "2",
        ],
        "forced": [
            "export", str(ledger), "-o", str(existing), "--check", "--model-path", str(model),
            "--ep-size", "2", "--force",
        ],
        "existing_file": str(existing),
        "exported": str(exported),
        "model": str(model),
        "results": str(directory / "results.json"),
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", SGLANG_SCRIPT, json.dumps(work)],
        env={**os.environ, **QUIET_SGLANG_ENV},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((directory / "results.json").read_text())
    results["ledger"] = ledger
    results["exported"] = exported
    return results


@pytest.mark.timeout(300)
def test_show_text_equals_sglangs_format_expert_location_layout(sglang_run):
    ours = [
        format_physical_to_logical_map(the_map, ep_size, layer_ids)
        for the_map, ep_size, layer_ids in FORMAT_CASES
    ]
    assert ours == sglang_run["formats"]


@pytest.mark.timeout(300)
def test_show_of_the_ledger_prints_sglangs_text_for_its_map(sglang_run, capsys):
    _, out, _ = run_cli(capsys, "show", str(sglang_run["ledger"]), "--ep-size", "2")
    assert out == sglang_run["formats"][1] + "\n"


@pytest.mark.timeout(300)
def test_export_check_loads_the_file_through_sglang_and_finds_the_ledgers_map(sglang_run):
    check = sglang_run["check"]
    assert (check["code"], check["err"]) == (exit_codes.OK, "")
    report = json.loads(check["out"])
    assert report["check"] == {
        "model_path": report["check"]["model_path"],
        "ep_size": 2,
        "equal": True,
        "detail": "sglang's metadata map equals the ledger's (4 layers x 6 physical slots)",
    }
    with LedgerReader(sglang_run["ledger"]) as reader:
        assert json.loads(Path(sglang_run["exported"]).read_text()) == {
            "physical_to_logical_map": reader.state().physical_to_logical_map
        }


@pytest.mark.timeout(300)
def test_export_check_never_replaces_an_existing_file_without_force(sglang_run):
    existing = sglang_run["existing"]
    assert existing["code"] == exit_codes.FAILED
    assert (
        "export never replaces a file: remove it, name another, or pass --force"
        in (existing["err"])
    )
    assert existing["file"] == "an operator's file\n"
    forced = sglang_run["forced"]
    assert (forced["code"], forced["err"]) == (exit_codes.OK, "")
    with LedgerReader(sglang_run["ledger"]) as reader:
        assert json.loads(forced["file"]) == {
            "physical_to_logical_map": reader.state().physical_to_logical_map
        }


@pytest.mark.timeout(300)
def test_export_check_fails_with_exit_5_for_a_model_of_another_shape(sglang_run):
    wrong = sglang_run["wrong_model"]
    detail = (
        "the model has 5 MoE layers x 4 logical experts but the ledger's maps have 4 layers x 4 "
        "logical experts"
    )
    assert wrong["code"] == exit_codes.INCONSISTENT
    assert wrong["err"] == f"layout-ledger export: error: check failed: {detail}\n"
    assert wrong["out"].endswith(f"check with sglang: FAILED: {detail}\n")


@pytest.mark.timeout(300)
def test_export_check_names_the_first_slot_where_sglangs_map_differs(sglang_run):
    assert sglang_run["tampered"]["equal"] is False
    assert sglang_run["tampered"]["detail"] == (
        "layer 2 slot 5: sglang's map holds 1, the ledger's 2"
    )


NO_SGLANG_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from layout_ledger.cli.app import main

    codes = [main(argv) for argv in json.loads(sys.argv[1])]
    heavy = sorted(name for name in ("sglang", "torch") if name in sys.modules)
    print(json.dumps({"codes": codes, "heavy": heavy}))
    """
)


@pytest.mark.timeout(120)
def test_no_command_but_export_check_imports_sglang_or_torch(tmp_path):
    ledger = str(build("clean", tmp_path / "clean.sqlite"))
    every_command = [
        ["status", ledger],
        ["history", ledger],
        ["show", ledger],
        ["diff", ledger, "0", "3"],
        ["export", ledger, "-o", str(tmp_path / "x.json")],
        ["verify", ledger],
        ["plot", ledger, "-o", str(tmp_path / "x.png"), "--moves"],
        ["prune", ledger, "--keep", "2"],
        ["upgrade", ledger],
    ]
    result = subprocess.run(
        [sys.executable, "-c", NO_SGLANG_SCRIPT, json.dumps(every_command)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    # status: 6, the built ledger's daemon was killed
    assert outcome == {"codes": [6] + [0] * (len(every_command) - 1), "heavy": []}


@pytest.mark.timeout(300)
def test_export_check_that_fails_leaves_no_file_behind(sglang_run):
    assert not Path(sglang_run["exported"]).with_name("again.json").exists()
    assert sglang_run["wrong_model"]["out"].startswith("checked ")
