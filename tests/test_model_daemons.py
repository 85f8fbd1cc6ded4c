"""Model-backed daemons: sglang's own daemon loads a real checkpoint into the slots its map names.

Per model (a tiny Qwen3-MoE in BF16, a tiny DeepSeek-V3 in FP8 blocks), one group of two
model-backed daemons (``sglang_integration.testing.daemons``: sglang's ``WeightCacheDaemon``
builds the model class from the checkpoint's ``config.json`` and loads its safetensors shards
with sglang's loader, on two gloo ranks; the GPU stand-ins are ``testing.gpu_stand_ins``) is
started once for the module, from an initial map (``--init-expert-location``) with a second
replica of an expert on each rank; in layer 1, expert 6 is a copy of expert 5 (tied experts).
What every engine on a daemon maps (its shared routed-expert file) is judged against the
checkpoint (``testing.checkpoint_experts``):

- each checkpoint expert lies in exactly the slots the daemon's map names, and in no other;
- the daemon's record starts at version 0 with that map and one fingerprint per local slot,
  and knows the tied experts;
- a fingerprint covers every routed tensor of a slot (w13, w2, and with FP8 their scales), and
  slots zero-filled, overwritten in part or moved without a commit read as on synthetic
  experts: the daemon's content check names each as the judge does (this test runs last: it
  leaves the daemons dirty).

Plus the two commands' contract, run as a person runs them (``checkpoint write``, ``daemons``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.checkpoint import main as checkpoint_main
from sglang_integration.testing.checkpoint_experts import CheckpointExperts, slots_holding
from sglang_integration.testing.daemon_control import request
from sglang_integration.testing.daemons import ModelDaemonGroup, start_model_daemons
from sglang_integration.testing.routed_weights import attach_routed_weights

pytestmark = pytest.mark.timeout(300)

NUM_EXPERTS, NUM_REDUNDANT, NUM_LAYERS = 8, 4, 3
LOCAL = (NUM_EXPERTS + NUM_REDUNDANT) // 2
# Per layer, 6 slots on each rank; rank 0 holds one expert twice, rank 1 another.
INITIAL = [
    [0, 1, 2, 3, 4, 0, 5, 6, 7, 5, 1, 2],
    [7, 6, 5, 4, 3, 3, 2, 1, 0, 5, 6, 4],
    [1, 3, 5, 7, 0, 5, 2, 4, 6, 6, 0, 1],
]
MODELS = {"qwen3_moe": "bf16", "deepseek_v3": "fp8_block"}
# Layer 1: expert 6 holds expert 5's bytes; each rank holds both, so each knows they are tied (a
# daemon that never held 5 reads 5's bytes as 6's: committed_content_problems, see the report).
TIED = (1, 6, 5)


@dataclass
class Started:
    model: str
    checkpoint: Path
    group: ModelDaemonGroup


@pytest.fixture(scope="module", params=sorted(MODELS))
def started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    model = str(request.param)
    root = tmp_path_factory.mktemp(model)
    checkpoint = write_checkpoint(
        root / "checkpoint", CheckpointSpec(model=model, dtype=MODELS[model], seed=7, tied=(TIED,))
    )
    group = start_model_daemons(
        root / "run",
        checkpoint,
        ep_size=2,
        num_redundant_experts=NUM_REDUNDANT,
        model=model,
        daemon_args=["--init-expert-location", json.dumps({"physical_to_logical_map": INITIAL})],
    )
    try:
        yield Started(model, checkpoint, group)
    finally:
        group.stop()


def test_each_checkpoint_expert_lands_in_exactly_the_slots_the_daemons_map_names(
    started: Started,
) -> None:
    experts = CheckpointExperts(started.checkpoint)
    held: dict[tuple[int, int], set[int]] = {}
    for rank in range(2):
        routed = attach_routed_weights(started.group.socket(rank))
        assert routed.first_slot == rank * LOCAL
        judged = experts.judge_routed(
            routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
        )
        for key, slots in slots_holding(judged, routed.first_slot).items():
            held.setdefault(key, set()).update(slots)
    moe_layers = sorted({layer for layer, _ in held})
    assert moe_layers == ([0, 1, 2] if started.model == "qwen3_moe" else [1, 2])
    layer, tied, same_as = TIED

    def same_bytes(layer_id: int, expert: int) -> set[int]:
        """The experts whose bytes ``expert``'s are (itself, and its tied partner)."""
        group = {tied, same_as}
        return group if layer_id == layer and expert in group else {expert}

    named = {
        (layer_id, expert): {
            slot for slot, e in enumerate(INITIAL[layer_id]) if e in same_bytes(layer_id, expert)
        }
        for layer_id in moe_layers
        for expert in range(NUM_EXPERTS)
    }
    assert held == named
    assert named[(layer, tied)] == {1, 2, 9, 10}  # expert 6's slots 1 and 10, 5's slots 2 and 9


def test_the_daemon_records_the_loaded_map_at_version_0_with_one_fingerprint_per_slot(
    started: Started,
) -> None:
    for rank in range(2):
        layout = request(started.group.socket(rank), {"type": "expert_layout_query"})["layout"]
        assert (layout["version"], layout["dirty"]) == (0, False)
        assert layout["physical_to_logical_map"] == INITIAL
        reply = request(started.group.socket(rank), {"type": "expert_layout_content_check"})
        assert reply["status"] == "ok", reply
        content = reply["content"]
        assert (content["first_slot"], content["dirty"]) == (rank * LOCAL, False)
        assert sorted(content["recorded"]) == (
            [0, 1, 2] if started.model == "qwen3_moe" else [1, 2]
        )
        assert all(len(values) == LOCAL for values in content["recorded"].values())
        assert content["current"] == content["recorded"]


def test_the_daemon_knows_the_tied_experts_its_slots_hold(
    started: Started, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli_ledgers import run_cli

    code, out, _ = run_cli(capsys, "status", started.group.ledger(0), "--json")
    assert code == 0
    assert json.loads(out)["ledgers"][0]["tied_experts"] == {"1": [[5, 6]]}
    _, out, _ = run_cli(capsys, "status", started.group.ledger(1), "--json")
    assert json.loads(out)["ledgers"][0]["tied_experts"] == {"1": [[5, 6]]}


def test_the_two_commands_write_a_checkpoint_and_serve_it_until_sigterm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The contract of ``checkpoint write`` and ``daemons``, run as a person runs them: the
    checkpoint command refuses a non-empty directory; the group serves ``RUN/rank{R}.sock`` with
    ``RUN/rank{R}.sqlite``, passes the daemon flags on (content check off: no fingerprints), a
    SIGKILL of one rank is that daemon's crash alone, and SIGTERM stops the rest cleanly."""
    import signal
    import sqlite3
    import subprocess
    import sys

    checkpoint, run = tmp_path / "deepseek", tmp_path / "run"
    write = [
        sys.executable,
        "-m",
        "sglang_integration.testing.checkpoint",
        "write",
        str(checkpoint),
    ]
    first = subprocess.run(
        [*write, "--model", "deepseek_v3", "--seed", "3"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"wrote {checkpoint}: deepseek_v3 bf16, 3 layers (2 MoE)")
    assert checkpoint_main(["write", str(checkpoint), "--model", "deepseek_v3"]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    command = [
        sys.executable, "-m", "sglang_integration.testing.daemons", "--model", "deepseek_v3",
        "--checkpoint", str(checkpoint), "--ep-size", "2", "--dir", str(run),
        "--num-redundant-experts", "2", "--expert-layout-content-check", "off",
    ]  # fmt: skip
    group = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert group.stdout is not None
        lines = [group.stdout.readline() for _ in range(2)]
        pids = [int(line.split()[3]) for line in lines]
        assert [line.split()[4:] for line in lines] == [
            ["socket", f"{run}/rank{rank}.sock", "ledger", f"{run}/rank{rank}.sqlite"]
            for rank in range(2)
        ]
        off = request(run / "rank0.sock", {"type": "expert_layout_content_check"})
        assert off["status"] == "no_record"
        os.kill(pids[1], signal.SIGKILL)
        assert request(run / "rank0.sock", {"type": "ping"}) == {"status": "ok"}
        assert group.poll() is None
        group.send_signal(signal.SIGTERM)
        assert group.wait(60) == 0
    finally:
        group.kill()
    with sqlite3.connect(f"file:{run}/rank0.sqlite?mode=ro", uri=True) as ledger:
        assert ledger.execute("SELECT end_state FROM ledger_incarnations").fetchall() == [
            ("clean",)
        ]
    with sqlite3.connect(f"file:{run}/rank1.sqlite?mode=ro", uri=True) as ledger:
        assert ledger.execute("SELECT end_state FROM ledger_incarnations").fetchall() == [(None,)]


def test_an_engine_moves_the_real_experts_and_the_next_one_adopts_them_every_slot_right(
    started: Started, tmp_path: Path
) -> None:
    """Engine ranks map the daemons' real routed-expert tensors (``EngineSpec.checkpoint``);
    sglang's updater moves them over gloo, the plugin commits each chunk, and the next engine
    adopts the daemons' version: every slot holds the expert its map names, as the checkpoint
    says (each rank's report judges its slots; this process judges them again)."""
    from dataclasses import replace

    from sglang_integration.testing.cpu_engine import CpuEngine, EngineSpec, free_port

    moe_layers = 3 if started.model == "qwen3_moe" else 2
    chunks = -(-moe_layers // 2)
    spec = EngineSpec(
        name="A",
        model_dir=str(started.checkpoint),
        expert_dir="",
        sockets=tuple(started.group.sockets),
        port=free_port(),
        num_redundant=NUM_REDUNDANT,
        layers_per_chunk=2,
        log_dir=str(tmp_path),
        checkpoint=str(started.checkpoint),
    )
    every_slot = moe_layers * LOCAL
    engine_a = CpuEngine.launch(spec)
    try:
        assert [r["matching"] for r in engine_a.started] == [every_slot] * 2
        moved = engine_a.rebalance(1)
    finally:
        engine_a.exit()
    assert [r["state"]["version"] for r in moved] == [chunks] * 2
    assert [r["matching"] for r in moved] == [every_slot] * 2
    a_map = moved[0]["map"]
    assert a_map != INITIAL
    engine_b = CpuEngine.launch(replace(spec, name="B", port=free_port()))
    try:
        assert not engine_b.failed, engine_b.failed[0]["error"]
        assert [r["session"]["version"] for r in engine_b.started] == [chunks] * 2
        assert [r["map"] for r in engine_b.started] == [a_map] * 2
        assert [r["matching"] for r in engine_b.started] == [every_slot] * 2
    finally:
        engine_b.exit()
    experts = CheckpointExperts(started.checkpoint)
    for rank in range(2):
        routed = attach_routed_weights(started.group.socket(rank))
        judged = experts.judge_routed(
            routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
        )
        for layer, contents in judged.items():
            named = a_map[layer][rank * LOCAL : (rank + 1) * LOCAL]
            assert all(c.holds(e) for c, e in zip(contents, named, strict=True)), (layer, rank)


def test_fingerprints_cover_every_routed_tensor_and_read_zero_partial_and_moved_slots(
    started: Started,
) -> None:
    """Leaves rank 0's daemon dirty: the last test of each model."""
    import torch

    from sglang_integration.content.fingerprints import fingerprint_hex, fingerprint_slots

    routed = attach_routed_weights(started.group.socket(0))
    layer = 2
    tensors = routed.routed_experts_weights_of_layer[layer]
    names = routed.names[layer]
    expected_names = ["w13_weight", "w2_weight"]
    if MODELS[started.model] == "fp8_block":
        expected_names += ["w13_weight_scale_inv", "w2_weight_scale_inv"]
    assert names == expected_names

    def prints() -> list[str]:
        return fingerprint_hex(fingerprint_slots(list(tensors), LOCAL))

    before = prints()
    for tensor in tensors:  # one byte of slot 4 in each tensor: only slot 4's fingerprint moves
        raw = tensor[4].view(torch.uint8).view(-1)
        raw[-1] ^= 0x01
        changed = [slot for slot, (a, b) in enumerate(zip(before, prints(), strict=True)) if a != b]
        raw[-1] ^= 0x01
        assert changed == [4]
    assert prints() == before

    row = request(started.group.socket(0), {"type": "expert_layout_query"})["layout"][
        "physical_to_logical_map"
    ][layer][:LOCAL]
    # Three slots whose experts differ from their sources' (the layout an engine may have moved).
    source, moved = next((a, b) for a in range(LOCAL) for b in range(LOCAL) if row[a] != row[b])
    zeroed, partial = [slot for slot in range(LOCAL) if slot not in (source, moved)][:2]
    partial_source = next(slot for slot in range(LOCAL) if row[slot] != row[partial])
    for tensor in tensors:
        tensor[moved].copy_(tensor[source])  # an expert moved in without a commit
        tensor[zeroed].zero_()
    for tensor in tensors[1:]:  # keeps its w13, the rest is another expert's
        tensor[partial].copy_(tensor[partial_source])
    judged = CheckpointExperts(started.checkpoint).judge_layer(layer, tensors, names, NUM_EXPERTS)
    assert judged[moved].text == judged[source].text == f"expert {row[source]}"
    assert judged[zeroed].text == "zero-filled"
    assert judged[partial].text.startswith("partial: ")
    assert f"of expert {row[partial]}" in judged[partial].text
    assert f"of expert {row[partial_source]}" in judged[partial].text
    reply = request(started.group.socket(0), {"type": "expert_layout_content_check"})
    content = reply["content"]
    assert content["dirty"], reply
    reason = content["dirty_reason"]
    for slot in (moved, zeroed, partial):
        held = judged[slot].text
        assert (
            f"layer {layer} slot {slot}: expert {row[slot]} by the record, holds {held}" in reason
        )
