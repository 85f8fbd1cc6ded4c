"""Engines check slot content at startup, and repair daemons an engine left mid-move.

Real processes, as in the demo (``demo_cases.workspace``): per EP rank a model-less daemon
serving its rank's shared-memory expert files (``--experts``: it fingerprints them at load, at
each commit and on request), and engines of 2 gloo ranks running sglang's real startup method
and EPLB code with the plugin's hooks, the ``ModelRunner.load_model`` hook included (around
the mapping of the same files).
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo_cases import DemoConfig, Workspace
from demo_cases.workspace import (
    held_map,
    matching,
    query_daemons,
    started_workspace,
    wait_for_daemons,
)
from sglang_integration.testing.shared_experts import attach_shared_experts, expert_values

pytestmark = pytest.mark.timeout(600)

CONFIG = DemoConfig()
OFF = (("SGLANG_EXPERT_LAYOUT_CONTENT_CHECK", "off"),)


@pytest.fixture(scope="module")
def workspace() -> Iterator[Workspace]:
    with started_workspace(CONFIG) as space:
        yield space


def _lines(report: dict[str, Any], level: str) -> list[str]:
    return [line for lvl, line in report.get("logs", []) if lvl == level]


def _dirty_pair(workspace: Workspace, case: str) -> tuple[list[Any], Path, int]:
    """Daemons serving fresh experts, engine A rebalanced once and SIGKILLed inside the move of
    the next rebalance's first chunk: both daemons dirty. The daemons, experts, base version."""
    experts = workspace.experts(case)
    daemons = workspace.daemons(case, experts=experts)
    engine_a = workspace.launch(case, "A", daemons, experts)
    engine_a.stop_in_move(1)
    engine_a.kill()
    wait_for_daemons(daemons, lambda layout: layout.dirty, "dirty")
    return daemons, experts, CONFIG.chunks_per_rebalance


def write_half(expert_dir: Path, rank: int, layer: int, local_slot: int, expert: int) -> Any:
    """Overwrite the first half of a slot's bytes (6 of its 12 words, all in its first tensor)
    with another expert's; returns the tensor and what to put back."""
    experts = attach_shared_experts(expert_dir, rank)
    tensor, width = experts.tensors[0], experts.shape.widths[0]
    half = sum(experts.shape.widths) // 2
    saved = tensor[layer, local_slot].clone()
    tensor[layer, local_slot, :half] = expert_values(layer, expert, 0, width)[:half]
    return tensor, saved


def test_an_engine_checks_every_loaded_slot_and_a_slot_holding_another_expert_fails_it(
    workspace: Workspace, tmp_path: Path
) -> None:
    experts = workspace.experts("loaded")
    daemons = workspace.daemons("loaded", experts=experts)
    engine = workspace.launch("loaded", "A", daemons, experts)
    lines = [_lines(report, "INFO") for report in engine.started]
    checked = "Every loaded expert slot holds the expert the layout names"
    assert all(any(line.startswith(checked) for line in rank_lines) for rank_lines in lines)
    engine.exit()
    wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    # An engine whose loader left a replica unfilled (its own mapping, not the daemons' bytes).
    own = workspace.shm_root / "loaded-engine-copy"
    shutil.copytree(experts, own)
    broken = attach_shared_experts(own, 1)
    for tensor in broken.tensors:
        tensor[5, 4].zero_()  # rank 1's local slot 4 = physical slot 10 (expert 2's replica)
    engine = workspace.launch("loaded", "B", daemons, own)
    assert [report["error_type"] for report in engine.failed] == ["ExpertLayoutStartupError"] * 2
    reason = engine.failed[0]["error"]
    assert "rank 1 layer 5 slot 10: expected expert 2, holds zero-filled" in reason
    assert engine.failed[1]["error"] == reason


def test_an_engine_repairs_daemons_left_mid_move_unless_a_slot_is_half_written(
    workspace: Workspace,
) -> None:
    daemons, experts, base = _dirty_pair(workspace, "repair")
    # With the content check off, startup fails as before this feature.
    off = workspace.launch("repair", "B-off", daemons, experts, env=OFF)
    assert len(off.failed) == 2 and "No repair" not in off.failed[0]["error"]
    assert "detached while its move" in off.failed[0]["error"]
    # A half-written slot in a pending layer: no repair, naming the slot; the daemons stay dirty.
    held = held_map(experts)[0][1]
    other = (held + 1) % CONFIG.num_logical_experts
    tensor, saved = write_half(experts, 0, 0, 1, expert=other)
    refused = workspace.launch("repair", "B-half", daemons, experts)
    reason = refused.failed[0]["error"] if refused.failed else "started"
    assert (
        "No repair is possible: slots hold unknown or partial content: rank 0 layer 0 slot 1 "
        f"holds partial: parts 0-1 of expert {other}, parts 2-3 of expert {held}"
    ) in reason
    assert all(reply.layout.dirty for reply in query_daemons(daemons))
    tensor[0, 1] = saved  # whole again
    engine_b = workspace.launch("repair", "B", daemons, experts)
    assert not engine_b.failed
    started = engine_b.started
    assert [r["session"]["version"] for r in started] == [base + 1] * 2
    held = held_map(experts)
    assert matching(held, started[0]["map"]) == CONFIG.all_slots
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [(layout.dirty, layout.version) for layout in layouts] == [(False, base + 1)] * 2
    warnings = _lines(started[0], "WARNING")
    assert any(line.startswith("Repaired the expert layout") for line in warnings), warnings
    again = engine_b.rebalance(1)  # the repaired daemons move experts again
    assert [r["state"]["version"] for r in again] == [base + 1 + CONFIG.chunks_per_rebalance] * 2
    assert sum(r["matching"] for r in again) == CONFIG.all_slots
    engine_b.exit()
    with sqlite3.connect(f"file:{daemons[0].ledger_path}?mode=ro", uri=True) as conn:
        kinds = [kind for (kind,) in conn.execute("SELECT kind FROM ledger_events")]
        dirty = conn.execute(
            "SELECT dirty FROM ledger_incarnations ORDER BY incarnation_id DESC"
        ).fetchone()
    assert kinds.count("repair") == 1 and dirty == (0,)


def test_daemons_that_record_no_fingerprints_start_the_engine_as_before_with_one_warning(
    workspace: Workspace,
) -> None:
    experts = workspace.experts("no-prints")
    daemons = workspace.daemons("no-prints")
    engine = workspace.launch("no-prints", "A", daemons, experts)
    assert not engine.failed
    warned = [
        [line for line in _lines(report, "WARNING") if "without the expert content check" in line]
        for report in engine.started
    ]
    assert [len(lines) for lines in warned] == [1, 0]
    assert "records no slot fingerprints" in warned[0][0]
    engine.exit()
