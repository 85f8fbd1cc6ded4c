"""Model-backed daemons heal from their checkpoint, and reload slots into a new map.

One group of two model-backed daemons (sglang's own ``WeightCacheDaemon`` building a tiny
Qwen3-MoE from its checkpoint, loaded by sglang's loader, the ranks in one gloo group) runs every
case in turn on the same ledgers: an engine SIGKILLed mid-move with half-written and zero-filled
slots (the daemons heal by themselves, every slot right against the checkpoint, at the same
version), a move left while another engine is attached (no heal by itself; ``expert_layout_heal``
heals it), ``expert_layout_reload`` into a new map (the version jumps, every slot right, verify
clean) and its refusals (nothing changes but one ``reload_refused``). A restart then restores the
reloaded version: the offer accepts the jump. Two more groups (Qwen3-MoE) cannot reload, and say
why: one with the content check off, one with the post-load stand-in (``--post-load-rescale``:
a backend whose post-load step changes the loaded experts).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.checkpoint_experts import CheckpointExperts, count_matching
from sglang_integration.testing.daemon_control import EngineStandIn, request
from sglang_integration.testing.daemons import ModelDaemonGroup, start_model_daemons
from sglang_integration.testing.gpu_stand_ins import post_load_factor
from sglang_integration.testing.routed_weights import attach_routed_weights

pytestmark = pytest.mark.timeout(600)

NUM_EXPERTS, NUM_REDUNDANT, NUM_LAYERS, RANKS = 8, 4, 3, 2
SLOTS = NUM_EXPERTS + NUM_REDUNDANT
LOCAL = SLOTS // RANKS
INITIAL = trivial_map(NUM_LAYERS, SLOTS, NUM_EXPERTS)


def _layout(group: ModelDaemonGroup, rank: int) -> dict[str, Any]:
    layout: dict[str, Any] = request(group.socket(rank), {"type": "expert_layout_query"})["layout"]
    return layout


def _wait_clean(group: ModelDaemonGroup, rank: int, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        layout = _layout(group, rank)
        if not layout["dirty"] or time.monotonic() > deadline:
            return layout
        time.sleep(0.05)


def _all_slots(group: ModelDaemonGroup) -> int:
    """A rank's local slots over its MoE layers (DeepSeek-V3's first layer is dense)."""
    return len(attach_routed_weights(group.socket(0)).routed_experts_weights_of_layer) * LOCAL


def _right_slots(group: ModelDaemonGroup, checkpoint: Path, rank: int) -> int:
    """How many of the rank's local slots hold, byte for byte, the checkpoint expert its map
    names."""
    routed = attach_routed_weights(group.socket(rank))
    held = CheckpointExperts(checkpoint).judge_routed(
        routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
    )
    the_map = _layout(group, rank)["physical_to_logical_map"]
    return count_matching(held, the_map, rank * LOCAL)


def _events(group: ModelDaemonGroup, rank: int) -> list[str]:
    """The kinds of the latest incarnation's events, in order."""
    with contextlib.closing(sqlite3.connect(f"file:{group.ledger(rank)}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT kind FROM events WHERE incarnation_id = "
            "(SELECT max(incarnation_id) FROM incarnations) ORDER BY event_id"
        ).fetchall()
    return [str(kind) for (kind,) in rows]


def _verified(group: ModelDaemonGroup, rank: int) -> None:
    with LedgerReader(group.ledger(rank)) as reader:
        report = collect_verify(reader)
    assert report.first_inconsistency is None, report


def _spoil_mid_move(group: ModelDaemonGroup) -> None:
    """What a move killed halfway leaves on rank 0: layer 1's slot 0 half-written (its first
    half from slot 1), layer 2's slot 2 zero-filled."""
    routed = attach_routed_weights(group.socket(0)).routed_experts_weights_of_layer
    for tensor in routed[1]:
        half = tensor.shape[1] // 2
        tensor[0][:half].copy_(tensor[1][:half])
    for tensor in routed[2]:
        tensor[2].zero_()


# Each model with the dtype it is released in: DeepSeek-V3's experts carry FP8 block scales.
MODELS = {"qwen3_moe": "bf16", "deepseek_v3": "fp8_block"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("heal")
    return write_checkpoint(root / "checkpoint", CheckpointSpec(model, MODELS[model], seed=7))


@pytest.fixture(scope="module")
def group(
    model: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModelDaemonGroup]:
    run = tmp_path_factory.mktemp("heal-run")
    started = start_model_daemons(
        run, checkpoint, ep_size=RANKS, num_redundant_experts=NUM_REDUNDANT, model=model
    )
    try:
        yield started
    finally:
        started.stop()


def test_a_daemon_left_mid_move_with_half_written_slots_heals_itself_at_its_version(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    before = [_layout(group, rank) for rank in range(RANKS)]
    engines = [EngineStandIn.start(group.socket(rank), "engine-a") for rank in range(RANKS)]
    for engine in engines:
        assert engine.begin(before[0]["version"], [1, 2]).ok
    _spoil_mid_move(group)
    assert _right_slots(group, checkpoint, 0) < _all_slots(group)
    for engine in engines:
        engine.kill()
    for rank in range(RANKS):
        healed = _wait_clean(group, rank)
        assert not healed["dirty"], healed["dirty_reason"]
        assert (healed["version"], healed["digest"]) == (
            before[rank]["version"],
            before[rank]["digest"],
        )
        assert _right_slots(group, checkpoint, rank) == _all_slots(group)
        kinds = _events(group, rank)
        assert kinds[-2:] == ["dirty", "heal"]
    assert "healed itself from the checkpoint: 2 layers [1, 2], 12 slots" in group.log(0)
    status = subprocess.run(
        [str(Path(sys.executable).parent / "layout-ledger"), "status", group.ledger(0), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    healing = json.loads(status.stdout)["ledgers"][0]["heal"]
    assert healing == {"mode": "auto", "available": True, "reason": None}


def test_a_daemon_another_engine_may_route_with_waits_to_be_asked_to_heal(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    version = _layout(group, 0)["version"]
    other = EngineStandIn.start(group.socket(0), "engine-b")
    mover = EngineStandIn.start(group.socket(0), "engine-a")
    try:
        # begin is busy while engine-b is attached, so leave the move by a content change
        _spoil_mid_move(group)
        check = request(group.socket(0), {"type": "expert_layout_content_check"})
        assert check["content"]["dirty"]
        time.sleep(0.5)
        assert _layout(group, 0)["dirty"]  # engine-b may route with the slots: no heal
        assert "dirty, not healing by itself: engines engine-b, engine-a may be routing" in (
            group.log(0).replace("engine-a, engine-b", "engine-b, engine-a")
        )
        cli = subprocess.run(
            [str(Path(sys.executable).parent / "layout-ledger"), "heal", group.socket(0)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        digest = _layout(group, 0)["digest"]
        assert cli.stderr == ""
        assert (cli.returncode, cli.stdout) == (
            0,
            f"{group.socket(0)}: healed from its checkpoint: clean at version {version} "
            f"(digest {digest[:12]})\n",
        )
        assert not _layout(group, 0)["dirty"]
        assert _right_slots(group, checkpoint, 0) == _all_slots(group)
        assert _events(group, 0)[-2:] == ["content_dirty", "heal"]
        refused = request(group.socket(0), {"type": "expert_layout_heal"})
        assert refused == {
            "status": "refused",
            "reason": "this daemon's expert layout is known (it is not dirty); there is "
            "nothing to heal",
        }
    finally:
        mover.exit()
        other.exit()


def _reload(group: ModelDaemonGroup, rank: int, base: int, version: int, the_map: Any) -> Any:
    return request(
        group.socket(rank),
        {
            "type": "expert_layout_reload",
            "engine_id": "engine-r",
            "base_version": base,
            "version": version,
            "digest": layout_digest(the_map),
            "physical_to_logical_map": the_map,
        },
        timeout=60,
    )


def test_a_reload_puts_the_checkpoint_into_a_new_map_and_jumps_the_version(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    new_map = [list(row) for row in INITIAL]
    new_map[1][0], new_map[1][1], new_map[1][LOCAL] = 3, 0, 1  # rank 0 and rank 1 slots
    new_map[2][5] = 7
    engines = [EngineStandIn.start(group.socket(rank), "engine-r") for rank in range(RANKS)]
    try:
        for rank in range(RANKS):
            base = _layout(group, rank)["version"]
            reply = _reload(group, rank, base, base + 5, new_map)
            assert reply["status"] == "ok", reply
            layout = reply["layout"]
            assert (layout["version"], layout["digest"]) == (base + 5, layout_digest(new_map))
            assert layout["physical_to_logical_map"] == new_map
            assert not layout["dirty"]
            assert _right_slots(group, checkpoint, rank) == _all_slots(group)
            assert _events(group, rank)[-2:] == ["begin", "reload"]
            _verified(group, rank)
    finally:
        for engine in engines:
            engine.exit()


def test_a_refused_reload_changes_nothing_but_its_one_event(group: ModelDaemonGroup) -> None:
    engine = EngineStandIn.start(group.socket(0), "engine-r")
    other = EngineStandIn.start(group.socket(0), "engine-x")
    try:
        before = _layout(group, 0)
        kinds = _events(group, 0)
        new_map = [list(row) for row in before["physical_to_logical_map"]]
        new_map[0][0], new_map[0][1] = new_map[0][1], new_map[0][0]
        reply = _reload(group, 0, before["version"], before["version"] + 1, new_map)
        assert reply["status"] == "refused"
        assert "other engines are attached to this daemon (engine-x)" in reply["reason"]
        other.exit()
        time.sleep(0.3)
        bad = dict(
            type="expert_layout_reload",
            engine_id="engine-r",
            base_version=before["version"],
            version=before["version"] + 1,
            digest="0" * 64,
            physical_to_logical_map=new_map,
        )
        reply = request(group.socket(0), bad)
        assert reply["status"] == "refused"
        assert reply["reason"].startswith("digest is not the layout digest")
        after = _layout(group, 0)
        assert (after["version"], after["digest"]) == (before["version"], before["digest"])
        new = _events(group, 0)[len(kinds) :]
        assert new == ["reload_refused", "detach", "reload_refused"]
    finally:
        engine.exit()
        other.exit()


def _swap_experts_in_file(shard: Path, layer: int, first: int, second: int) -> None:
    """Experts ``first`` and ``second`` of ``layer`` trade their tensors in ``shard`` (the index
    and the shapes stay as they were: the checkpoint's weights changed under the same names)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    a, b = (
        f"model.layers.{layer}.mlp.experts.{first}.",
        f"model.layers.{layer}.mlp.experts.{second}.",
    )
    swapped = dict(tensors)
    for name in tensors:
        if name.startswith(a):
            swapped[name] = tensors[b + name.removeprefix(a)]
            swapped[b + name.removeprefix(a)] = tensors[name]
    save_file(swapped, str(shard), metadata={"format": "pt"})


def _heal_failed_reason(group: ModelDaemonGroup, rank: int) -> str:
    with contextlib.closing(sqlite3.connect(f"file:{group.ledger(rank)}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT reason FROM events WHERE kind = 'heal_failed' ORDER BY event_id DESC LIMIT 1"
        ).fetchone()
    return "" if row is None else str(row[0])


def test_a_heal_leaves_the_daemon_dirty_while_the_checkpoint_is_missing_or_changed(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    shard = checkpoint / "model-00002-of-00002.safetensors"  # odd layers' tensors
    original = shard.read_bytes()
    version = _layout(group, 0)["version"]
    try:
        shard.unlink()
        _spoil_mid_move(group)
        request(group.socket(0), {"type": "expert_layout_content_check"})
        deadline = time.monotonic() + 60
        while "heal_failed" not in _events(group, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _events(group, 0)[-2:] == ["content_dirty", "heal_failed"]
        assert f"the checkpoint file {shard} cannot be read" in _heal_failed_reason(group, 0)
        assert _layout(group, 0)["dirty"]

        shard.write_bytes(original)
        held = _layout(group, 0)["physical_to_logical_map"][1][0]
        _swap_experts_in_file(shard, 1, held, (held + 1) % NUM_EXPERTS)
        reply = request(group.socket(0), {"type": "expert_layout_heal"}, timeout=60)
        assert reply["status"] == "refused"
        assert (
            "after the reload, slots still differ from the record: layer 1 slot 0"
            in (reply["reason"])
        )
        assert _layout(group, 0)["dirty"]

        shard.write_bytes(original)
        reply = request(group.socket(0), {"type": "expert_layout_heal"}, timeout=60)
        assert reply["status"] == "ok", reply
        assert (reply["layout"]["dirty"], reply["layout"]["version"]) == (False, version)
        assert _right_slots(group, checkpoint, 0) == _all_slots(group)
        assert _events(group, 0)[-4:] == ["content_dirty", "heal_failed", "heal_failed", "heal"]
        _verified(group, 0)
    finally:
        shard.write_bytes(original)


def test_a_restart_after_a_reload_restores_the_version_it_jumped_to(
    group: ModelDaemonGroup, checkpoint: Path, model: str
) -> None:
    before = [_layout(group, rank) for rank in range(RANKS)]
    assert group.stop() == [0, 0]
    again = start_model_daemons(
        Path(group.spec.run_dir),
        checkpoint,
        ep_size=RANKS,
        num_redundant_experts=NUM_REDUNDANT,
        model=model,
    )
    try:
        for rank in range(RANKS):
            layout = _layout(again, rank)
            assert (layout["version"], layout["digest"]) == (
                before[rank]["version"],
                before[rank]["digest"],
            )
            assert layout["restored_from"]["version"] == before[rank]["version"]
            assert _right_slots(again, checkpoint, rank) == _all_slots(again)
            _verified(again, rank)
    finally:
        assert again.stop() == [0, 0]


def test_a_daemon_that_cannot_verify_reloaded_slots_refuses_reloads_and_says_why(
    checkpoint: Path, model: str, tmp_path: Path
) -> None:
    if model != "qwen3_moe":
        pytest.skip("one model is enough: the reason comes before any model code")
    group = start_model_daemons(
        tmp_path / "run",
        checkpoint,
        ep_size=RANKS,
        num_redundant_experts=NUM_REDUNDANT,
        model=model,
        daemon_args=["--expert-layout-content-check", "off"],
    )
    reason = (
        "it records no slot fingerprints (--expert-layout-content-check off, or no "
        "routed-expert tensors), so it could not verify reloaded slots"
    )
    try:
        engine = EngineStandIn.start(group.socket(0), "engine-r")
        new_map = [list(row) for row in INITIAL]
        new_map[1][0], new_map[1][1] = new_map[1][1], new_map[1][0]
        reply = _reload(group, 0, 0, 1, new_map)
        assert reply == {
            "status": "refused",
            "reason": f"this daemon cannot reload from its checkpoint: {reason}",
        }
        engine.exit()
        assert f"no heal or reload from the checkpoint: {reason}" in group.log(0)
        status = subprocess.run(
            [str(Path(sys.executable).parent / "layout-ledger"), "status", group.ledger(0)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert f"heal:                unavailable: {reason}" in status.stdout
    finally:
        group.stop()


def _right_slots_as_loaded(group: ModelDaemonGroup, checkpoint: Path, rank: int) -> int:
    """How many of the rank's local slots hold, byte for byte, the checkpoint expert its map
    names as the post-load stand-in leaves it (``gpu_stand_ins.post_load_factor``): the factor
    undone on a copy (a power of two: exact), then judged. Judged against the checkpoint, not
    the load's recorded fingerprints: they are taken after the load-time reload check, so they
    would agree with slots the check failed to put back."""
    routed = attach_routed_weights(group.socket(rank))
    undone = {
        layer: [
            tensor.clone().mul_(1.0 / post_load_factor(name, tensor))
            for tensor, name in zip(tensors, routed.names[layer], strict=True)
        ]
        for layer, tensors in routed.routed_experts_weights_of_layer.items()
    }
    held = CheckpointExperts(checkpoint).judge_routed(undone, routed.names, NUM_EXPERTS)
    the_map = _layout(group, rank)["physical_to_logical_map"]
    return count_matching(held, the_map, rank * LOCAL)


def _ask(group: ModelDaemonGroup, rank: int, message: dict[str, Any]) -> Any:
    return request(group.socket(rank), message, timeout=60)


def _status(*ledgers: str, json_output: bool = False) -> str:
    cli = subprocess.run(
        [
            str(Path(sys.executable).parent / "layout-ledger"),
            "status",
            *ledgers,
            *(["--json"] if json_output else []),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return cli.stdout


def test_a_daemon_whose_post_load_step_changes_the_experts_refuses_heal_and_reload_and_says_why(
    checkpoint: Path, model: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Only where a raw reload is right (issue 32): the daemon's load-time check finds that a
    raw reload would not give back what its load left, turns heal and reload off with the
    reason, and puts the slots it tried back as its load left them."""
    if model != "qwen3_moe":
        pytest.skip("one model is enough: the check is the same for every model")
    plain: ModelDaemonGroup = request.getfixturevalue("group")
    rescaled = start_model_daemons(
        tmp_path / "run",
        checkpoint,
        ep_size=RANKS,
        num_redundant_experts=NUM_REDUNDANT,
        model=model,
        daemon_args=["--post-load-rescale"],
    )
    reason = (
        "sglang's post-load processing changes the experts on this backend (layer 0's tensor 0 "
        "differs after a raw reload from the checkpoint); heal and reload are off, a dirty "
        "daemon must be restarted"
    )
    try:
        for rank in range(RANKS):
            assert f"no heal or reload from the checkpoint: {reason}" in rescaled.log(rank)
            # No slot holds the checkpoint's bytes; every one holds what the load left (the
            # check's reload of layer 0 was put back).
            assert _right_slots(rescaled, checkpoint, rank) == 0
            assert _right_slots_as_loaded(rescaled, checkpoint, rank) == _all_slots(rescaled)
        assert f"heal:                unavailable: {reason}\n" in _status(rescaled.ledger(0))
        reports = json.loads(_status(plain.ledger(0), rescaled.ledger(0), json_output=True))
        assert [report["heal"] for report in reports["ledgers"]] == [
            {"mode": "auto", "available": True, "reason": None},
            {"mode": None, "available": False, "reason": reason},
        ]

        before, kinds = _layout(rescaled, 0), _events(rescaled, 0)
        engine = EngineStandIn.start(rescaled.socket(0), "engine-r")
        new_map = [list(row) for row in before["physical_to_logical_map"]]
        new_map[1][0], new_map[1][1] = new_map[1][1], new_map[1][0]
        reply = _reload(rescaled, 0, before["version"], before["version"] + 1, new_map)
        assert reply == {
            "status": "refused",
            "reason": f"this daemon cannot reload from its checkpoint: {reason}",
        }
        engine.exit()
        deadline = time.monotonic() + 30
        while _events(rescaled, 0)[-1] != "detach" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _right_slots_as_loaded(rescaled, checkpoint, 0) == _all_slots(rescaled)

        _spoil_mid_move(rescaled)
        check = _ask(rescaled, 0, {"type": "expert_layout_content_check"})
        assert check["content"]["dirty"]
        reply = _ask(rescaled, 0, {"type": "expert_layout_heal"})
        assert reply == {
            "status": "refused",
            "reason": f"this daemon cannot heal: {reason}; restart it",
        }
        time.sleep(0.3)  # no heal of its own follows
        after = _layout(rescaled, 0)
        assert after["dirty"]
        assert (after["version"], after["digest"]) == (before["version"], before["digest"])
        assert _events(rescaled, 0)[len(kinds) :] == [
            "attach",
            "reload_refused",
            "detach",
            "content_dirty",
            "heal_refused",
        ]
        _verified(rescaled, 0)
    finally:
        rescaled.stop()
