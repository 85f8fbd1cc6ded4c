"""The one-GPU check (``scripts/gpu_check_single.sh``, ``scripts/gpu_single``) on its CPU path.

The CPU path runs the same processes as the GPU run (holder, model-less daemons with ledgers,
engines A, B and B-ignoring-the-record) and shares the memory through the same torch IPC
reductions, on CPU tensors (shared-memory files). The GPU itself is not tested here.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_single import daemons, results
from gpu_single.bench_stage import run_bench_stage
from gpu_single.expert_bytes import (
    HOLDS_NO_EXPERT,
    ExpertBytesError,
    bases_for,
    fill_layer,
    held_experts,
    move_layer,
    slot_words,
)
from gpu_single.fingerprint_stage import (
    FINGERPRINT_MODULE,
    find_fingerprint_function,
    fingerprint_rows,
    measure_fingerprints,
)
from gpu_single.geometry import small_geometry
from gpu_single.moves import demo_case1_moves
from gpu_single.standin_framing import recv_msg, send_msg
from layout_ledger.core.layout import validate_map

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check_single.sh"


def _run_check(tmp_path: Path, *args: str, timeout: float = 200) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "check.json"
    result = subprocess.run(
        [str(SCRIPT), "--device", "cpu", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    document = json.loads(out.read_text()) if out.exists() else {}
    return result.returncode, result.stdout + result.stderr, document


def _stage(document: dict[str, Any], name: str) -> dict[str, Any]:
    (stage,) = [s for s in document["stages"] if s["name"] == name]
    return stage


def _measured(stage: dict[str, Any], what_start: str) -> str:
    (row,) = [r for r in stage["rows"] if r["what"].startswith(what_start)]
    return str(row["measured"])


def _failed_rows(document: dict[str, Any]) -> list[str]:
    return [
        f"{stage['name']}: {row['what']}: expected {row['expected']}, measured {row['measured']}"
        for stage in document["stages"]
        for row in stage["rows"]
        if row["ok"] is False
    ]


@pytest.mark.timeout(300)
def test_cpu_path_shares_experts_by_torch_ipc_and_b_adopts_the_ledger_with_sglangs_daemon(
    tmp_path: Path,
) -> None:
    code, output, document = _run_check(
        tmp_path, "--daemon", "sglang", "--stages", "ipc,fingerprints"
    )
    assert code == 0, output[-4000:]
    assert _failed_rows(document) == []
    assert document["versions"]["daemon"].startswith("sglang")
    setup = _stage(document, "1 setup")
    assert "rebuild_storage_filename" in _measured(setup, "the IPC handles")
    assert _measured(setup, "framing the engines' client").startswith("sglang's")
    small = _stage(document, "1 small")
    # The CPU demo's case 1 (docs/demo.md): version 20, B 96/96 right, the record ignored 85/96.
    assert _measured(small, "daemon version after A") == "20"
    assert _measured(small, "B adopts the ledger's version") == "20"
    assert _measured(small, "B: slots holding the expert") == "96/96"
    assert _measured(small, "B ignoring the record: slots read wrongly") == "85/96"
    layer = _stage(document, "1 deepseek-v3-layer")
    assert _measured(layer, "B: slots holding the expert") == "36/36"
    fingerprints = _stage(document, "2 fingerprints")
    assert (
        fingerprints["status"] == "ran"
    )  # sglang_integration.content.fingerprints, on this device
    assert _failed_rows(document) == []
    assert "checks held" in output


@pytest.mark.timeout(240)
def test_cpu_path_with_the_stand_in_daemon_holds_and_names_what_it_stands_in_for(
    tmp_path: Path,
) -> None:
    code, output, document = _run_check(tmp_path, "--daemon", "ledger-service", "--stages", "ipc")
    assert code == 0, output[-4000:]
    assert _failed_rows(document) == []
    setup = _stage(document, "1 setup")
    assert daemons.STAND_IN_NOTE in setup["notes"]
    assert daemons.STAND_IN_NOTE in output
    assert _measured(setup, "framing the engines' client").startswith("stand-in")
    assert _measured(_stage(document, "1 small"), "B: slots read wrongly") == "0/96"


def test_the_check_exits_2_naming_the_cause_when_torch_sees_no_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = subprocess.run(
        [str(SCRIPT), "--stages", "bench"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    assert result.returncode == 2
    assert "torch sees no CUDA device" in result.stdout


def test_exit_code_is_1_for_a_failed_check_and_2_for_a_stage_that_did_not_finish() -> None:
    held = results.Stage("a", "A")
    held.check("x", 1, 1, True)
    failed = results.Stage("b", "B")
    failed.check("x", 1, 2, False)
    broken = results.Stage("c", "C", status="failed: a process died")
    assert results.exit_code([held]) == 0
    assert results.exit_code([held, failed]) == 1
    assert results.exit_code([held, failed, broken]) == 2


def test_a_stage_stopped_by_an_error_is_reported_as_not_finished_and_exits_2() -> None:
    from gpu_single.run import guarded

    (stage,) = guarded("bench", lambda: [results.Stage("bench", "B")] if 1 / 0 else [])
    assert stage.status.startswith("failed")
    assert "ZeroDivisionError" in stage.notes[0]
    assert results.exit_code([stage]) == 2


def test_engine_a_replays_the_cpu_demos_case_1_commits_which_leave_11_of_96_slots_unmoved() -> None:
    geometry = small_geometry()
    plan = demo_case1_moves(geometry)
    assert (len(plan.commits), plan.rebalances, plan.chunks_per_rebalance) == (20, 10, 2)
    initial = geometry.initial_map()
    final = validate_map(plan.final_map(initial), geometry.layout_geometry())
    unmoved = sum(
        a == b
        for row, first in zip(final, initial, strict=True)
        for a, b in zip(row, first, strict=True)
    )
    assert unmoved == 11


def _filled_small_layer() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    geometry = small_geometry()
    tensors = [
        torch.empty((geometry.num_local_slots, *spec.slot_shape), dtype=getattr(torch, spec.dtype))
        for spec in geometry.tensors
    ]
    row = geometry.local_rows(geometry.initial_map())[0]
    bases = bases_for(tensors)
    fill_layer(tensors, 0, row, bases)
    return tensors, bases, row


def test_a_slot_holding_parts_of_two_experts_reads_as_holding_no_expert() -> None:
    tensors, bases, row = _filled_small_layer()
    assert held_experts(tensors, 0, 8, bases) == row
    words = slot_words(tensors[1])
    half = words.shape[1] // 2
    words[5, half:] = words[6, half:]
    held = held_experts(tensors, 0, 8, bases)
    assert held[5] == HOLDS_NO_EXPERT
    assert held[:5] + held[6:] == row[:5] + row[6:]


def test_a_move_in_place_leaves_every_slot_holding_its_new_expert_whole() -> None:
    tensors, bases, row = _filled_small_layer()
    new_row = [7, 7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2]
    moved, copied = move_layer(tensors, row, new_row)
    assert held_experts(tensors, 0, 8, bases) == new_row
    assert moved == sum(a != b for a, b in zip(row, new_row, strict=True))
    assert copied == moved * small_geometry().slot_bytes
    with pytest.raises(ExpertBytesError, match="on no local slot"):
        move_layer(tensors, [0] * 12, new_row)


def test_fingerprint_stage_finds_the_function_sglang_integration_provides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang_integration.content.fingerprints import fingerprint_slots as provided

    assert find_fingerprint_function() is provided
    monkeypatch.setitem(sys.modules, FINGERPRINT_MODULE, None)  # an older version: none
    assert find_fingerprint_function() is None
    module = types.ModuleType(FINGERPRINT_MODULE)

    def fingerprint_slots(tensors: list[torch.Tensor], num_slots: int) -> torch.Tensor:
        return torch.zeros(num_slots)

    module.fingerprint_slots = fingerprint_slots  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, FINGERPRINT_MODULE, module)
    assert find_fingerprint_function() is fingerprint_slots


def _content_fingerprint(tensors: list[torch.Tensor], num_slots: int) -> torch.Tensor:
    """Every word of the slot, weighted by its position, in every tensor."""
    columns = []
    for tensor in tensors:
        words = slot_words(tensor).to(torch.int64)
        weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64)
        columns.append((words * weights).sum(dim=1))
    return torch.stack(columns, dim=1)


def _first_word_fingerprint(tensors: list[torch.Tensor], num_slots: int) -> torch.Tensor:
    """Too weak: only the first word of the first tensor (misses a torn slot)."""
    return slot_words(tensors[0])[:, 0].clone()


def test_fingerprint_stage_detects_a_half_overwritten_slot_and_a_zeroed_replica() -> None:
    report = measure_fingerprints("cpu", 2, 64, 1 << 20, function=_content_fingerprint)
    stage = results.Stage("2", "fingerprints")
    fingerprint_rows(stage, report)
    assert [row.what for row in stage.failed] == []
    assert report["torn_detected"] and report["zeroed_detected"] and report["others_unchanged"]
    assert report["replicas_equal"] == report["replicas"] == 8
    assert report["bytes"] > 0 and report["copy_rate"] > 0


def test_fingerprint_stage_fails_its_check_for_a_fingerprint_blind_to_a_torn_slot() -> None:
    report = measure_fingerprints("cpu", 2, 64, 1 << 20, function=_first_word_fingerprint)
    stage = results.Stage("2", "fingerprints")
    fingerprint_rows(stage, report)
    assert [row.what for row in stage.failed] == ["a half-overwritten slot detected"]


def test_bench_stage_fails_its_check_when_the_benchmark_exits_non_zero(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys\nprint('(b) rebuild')\nprint('    ratio:  0.5   (target < 1.5)')\n"
    )
    held = run_bench_stage(sys.executable, tmp_path / "ok", script)
    assert held.failed == [] and held.rows[0].measured == "0"
    assert ("bench (b) ratio", "0.5   (target < 1.5)") in [(r.what, r.measured) for r in held.rows]
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    stage = run_bench_stage(sys.executable, tmp_path / "fail", failing)
    assert [row.what for row in stage.failed] == ["exit code"]
    assert results.exit_code([stage]) == 1


def test_stand_in_framing_round_trips_plain_data_and_refuses_to_unpickle_code() -> None:
    left, right = socket.socketpair()
    with left, right:
        send_msg(left, {"type": "expert_layout_query", "rows": {0: [1, 2]}})
        assert recv_msg(right) == {"type": "expert_layout_query", "rows": {0: [1, 2]}}
        data = pickle.dumps({"call": os.getcwd})
        left.sendall(struct.pack("!I", len(data)) + data)
        with pytest.raises(pickle.UnpicklingError, match="plain data only"):
            recv_msg(right)


def test_gpu_wheels_pins_every_wheel_from_the_requirements_files() -> None:
    def listed(*flags: str) -> list[str]:
        result = subprocess.run(
            [str(ROOT / "scripts" / "gpu_wheels.sh"), "--list", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return result.stdout.split()

    full, own = listed(), listed("--without-sglang")
    assert all(spec.count("==") == 1 for spec in full)
    assert {"sglang==0.5.23", "SQLAlchemy==2.0.58", "alembic==1.20.1", "Mako==1.4.3"} <= set(full)
    assert not [spec for spec in own if spec.startswith("sglang")]
    assert set(own) < set(full)
