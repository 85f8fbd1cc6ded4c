"""Case 7 (a): a daemon heals itself, no restart.

Engine A rebalances once and is SIGKILLed inside the move of its next rebalance's first chunk;
one slot of a pending layer is half-written (its first half another expert's bytes) and another
zero-filled, on rank 0. With ``--expert-layout-heal auto`` the daemons, not restarted (the same
processes), reload the pending layers' local slots from the checkpoint into the last committed
layout and are clean again within seconds at that version; engine B starts on them at that
version with every slot right against the checkpoint. The bytes each heal read (its ``heal``
event) beside what a full load reads (the checkpoint's weights). Model-backed daemons only: the
model-less stand-in has no checkpoint to reload from.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from pathlib import Path

from demo_cases.results import CaseResult, both, per_rank, slots, yes
from demo_cases.workspace import Workspace, matching, query_daemons, wait_for_daemons

# What the heal event's reason carries (layout_ledger.core.reloads.ReloadReport.describe).
_HEAL_REASON = re.compile(r"(\d+) layers \[.*\], (\d+) slots, ([\d,]+) bytes read, ([\d.]+) s")


def run_case7(workspace: Workspace) -> CaseResult:
    """A killed mid-move with damaged slots; the daemons heal; B starts on them."""
    result = CaseResult("Case 7 (a): a dirty daemon heals itself from its checkpoint")
    started = time.monotonic()
    if not workspace.model_backed:
        result.info("skipped", "model-less daemons have no checkpoint to reload from")
        return result
    config = workspace.config
    expert_dir = workspace.experts("case7")
    daemons = workspace.daemons("case7", experts=expert_dir, flags=["--expert-layout-heal", "auto"])
    pids = [daemon.pid for daemon in daemons]
    engine_a = workspace.launch("case7", "A", daemons, expert_dir)
    engine_a.stop_in_move(1)
    base = config.chunks_per_rebalance
    pending = query_daemons(daemons)[0].layout.pending
    layers = [] if pending is None else list(pending.layers)
    first = config.moe_layer_ids[0]
    held, written = workspace.overwrite_half(expert_dir, first, 1)
    _zero_slot(expert_dir, first + 1 if len(layers) > 1 else first, 2)
    damaged = config.all_slots - matching(
        workspace.held_map(expert_dir),
        config.moe_rows(query_daemons(daemons)[0].layout.physical_to_logical_map),
    )
    result.info(
        "A SIGKILLed in its move: pending layers; slots not what the version names",
        f"{layers}; {slots(damaged, config)} (a half-written slot: expert {held} with "
        f"{written}'s first half; a zero-filled one)",
    )
    killed = time.monotonic()
    engine_a.kill()
    layouts = wait_for_daemons(
        daemons, lambda layout: not layout.attached and not layout.dirty, "healed"
    )
    healed_in = time.monotonic() - killed
    result.check(
        "the daemons heal themselves, clean at the last committed version",
        both(f"clean, version {base}", config.ep_size),
        per_rank(
            f"{'dirty' if layout.dirty else 'clean'}, version {layout.version}"
            for layout in layouts
        ),
        all(not layout.dirty and layout.version == base for layout in layouts),
    )
    result.check(
        "no restart: the same daemon processes",
        "yes",
        yes([daemon.pid for daemon in daemons] == pids),
        [daemon.pid for daemon in daemons] == pids,
    )
    result.check(
        "seconds from the SIGKILL to both clean", "< 10", f"{healed_in:.2f}", healed_in < 10
    )
    heals = [_last_heal(Path(daemon.ledger_path)) for daemon in daemons]
    read = [bytes_read for _, bytes_read in heals]
    full = _checkpoint_weight_bytes(workspace)
    result.info(
        "bytes each heal read (its heal event) / a full load reads",
        f"{per_rank(f'{count:,}' for count in read)} / {full:,} ({full / max(read):,.0f}x more)",
    )
    engine_b = workspace.launch("case7", "B", daemons, expert_dir)
    b_versions = [int(report["session"]["version"]) for report in engine_b.started]
    result.check(
        "B starts on version",
        both(base, config.ep_size),
        per_rank(b_versions),
        all(version == base for version in b_versions),
    )
    right = sum(report["matching"] for report in engine_b.started)
    result.check(
        "B: slots holding the expert its map names (vs the checkpoint)",
        slots(config.all_slots, config),
        slots(right, config),
        right == config.all_slots,
    )
    if workspace.answers_tokens:
        workspace.answer(
            result, "B after A's SIGKILL mid-move and the daemons' heal (case 7 (a))", engine_b
        )
    engine_b.exit()
    for daemon in daemons:
        daemon.stop()
    result.facts.update(
        healed_in=healed_in, heal_bytes=read, full_bytes=full, layers=layers, damaged=damaged
    )
    result.seconds = time.monotonic() - started
    return result


def _zero_slot(expert_dir: Path, layer: int, slot: int) -> None:
    """Rank 0's ``slot`` of ``layer`` zero-filled, as a mover killed before its copy leaves it."""
    from sglang_integration.testing.routed_weights import attach_routed_weights

    tensors = attach_routed_weights(expert_dir / "rank0.sock").routed_experts_weights_of_layer
    for tensor in tensors[layer]:
        tensor[slot].zero_()


def _last_heal(ledger: Path) -> tuple[int, int]:
    """(slots, bytes read) of the ledger's last ``heal`` event."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT reason FROM events WHERE kind = 'heal' ORDER BY event_id DESC LIMIT 1"
        ).fetchone()
    match = _HEAL_REASON.match("" if row is None else str(row[0]))
    if match is None:
        return 0, 0
    return int(match[2]), int(match[3].replace(",", ""))


def _checkpoint_weight_bytes(workspace: Workspace) -> int:
    """The checkpoint's weights as a full load reads them (its index's ``total_size``)."""
    import json

    if workspace.checkpoint is None:
        return 0
    index = json.loads((Path(workspace.checkpoint) / "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])
