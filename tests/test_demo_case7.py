"""Demo case 7 (a) on model-backed daemons (``scripts/demo_cases/case7.py``), both models: an
engine SIGKILLed mid-move leaves half-written and zero-filled slots; the daemons heal themselves
with no restart (the same processes), clean at the last committed version within seconds, and
engine B starts on them with every slot right against the checkpoint, each heal reading a small
part of what a full load reads.
"""

from __future__ import annotations

import pytest

from demo_cases import DemoConfig
from demo_cases.case7 import run_case7
from demo_cases.workspace import started_workspace

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_a_daemon_left_mid_move_heals_itself_and_engine_b_starts_on_it(model: str) -> None:
    config = DemoConfig(model=model)
    with started_workspace(config) as workspace:
        case = run_case7(workspace)
    failed = [
        f"{check.what}: expected {check.expected}, got {check.measured}" for check in case.failed
    ]
    assert not failed, failed
    assert len(case.checks) == 8  # 7 of the slots and the heal, 1 of what B answers
    facts = case.facts
    assert facts["damaged"] >= 2
    assert facts["layers"] == config.moe_layer_ids[: config.layers_per_chunk]
    # the pending chunk is half the MoE layers, and each daemon holds half their slots
    assert all(0 < read < facts["full_bytes"] / 2 for read in facts["heal_bytes"])
