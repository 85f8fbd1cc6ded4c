#!/usr/bin/env python3
"""Heal campaign: SIGKILL a model-backed daemon at random moments, most of them during heals.

A group of two model-backed daemons (sglang's own ``WeightCacheDaemon`` loading a tiny
checkpoint with sglang's loader, this plugin's hooks, ``--expert-layout-heal auto``; EPLB needs
two EP ranks) serves an engine that commits real moves (on each rank it swaps two local slots'
bytes in the shared weights and commits the swapped row) and then, in most rounds, begins a
move, half-writes one slot and zero-fills another of the pending layers on rank 0 and is
SIGKILLed: the daemons heal themselves. Each round SIGKILLs both daemons (rank 0 at the random
moment, rank 1 right after: two kills), then restarts the group on the same ledgers. The
daemons' reloads are slowed (``--reload-delay`` per layer, in this script's daemon processes
only: a heal of the tiny model takes milliseconds), and the kill comes at a random moment of
that window, so about half the kills land during a heal.
After each kill:

- every commit the daemon acknowledged must be in the ledger, with its digest (lost: 0);
- the killed incarnation never ended ``clean``, and where its history (replayed by the rules
  every reader uses) says it was clean at the kill, every slot of the killed daemon's weights
  (their shared-memory file, read after the kill) holds the checkpoint expert its map names:
  a heal never left it clean with a wrong slot (wrong clean states: 0);
- ``verify``'s checks of that incarnation pass; the restart restores the killed incarnation's
  newest committed version (``crash_campaign._check_restore``) and loads every slot right.

Blocked and slow shards (issue 40): in a share of the heal rounds the shard holding the first
pending layer is put on a real FUSE mount over the file (``testing.stalled_mount``) while the
daemons heal: ``blocked`` (no read is ever answered: the heal must fail at the read deadline,
``--expert-layout-heal-timeout``, and the kill may land while a reader child sleeps in the
kernel) or ``slow`` (every read answered after ``--slow-read`` seconds). All along, both daemons
are asked ``ping`` and ``expert_layout_query`` ten times a second: each must answer within 1 s
(unanswered: must be 0). The mount goes away after the kill, before the restart.

    .venv/bin/python scripts/heal_campaign.py [--kills 200] [--model qwen3_moe|deepseek_v3]
        [--seed N] [--reload-delay SECONDS] [--blocked 0.2] [--slow 0.2] [--slow-read SECONDS]
        [--heal-timeout SECONDS]

Prints one table (kills, of them during heals, the shard rounds; what must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crash_campaign import Tally, _check_restore
from layout_ledger.core.layout import layout_digest
from layout_ledger.history.checks import verify_incarnation
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.rows import incarnation

if TYPE_CHECKING:
    from sglang_integration.testing.daemon_prober import DaemonProber

NUM_EXPERTS, REDUNDANT, RANKS = 8, 4, 2
LOCAL = (NUM_EXPERTS + REDUNDANT) // RANKS  # each rank's local slots
HEAL_ROUNDS = 0.85  # the share of rounds that end with a heal under way


ANSWER_WITHIN = 1.0  # seconds every request has during a heal, blocked shard or not


@dataclass
class HealTally(Tally):
    during_heals: int = 0  # kills after a heal began reloading and before it was recorded
    heals_recorded: int = 0  # kills after the heal was recorded (the daemon clean again)
    wrong_clean: int = 0  # a clean state whose slots do not hold what the map names
    shard_rounds: dict[str, int] = field(default_factory=dict)  # blocked / slow: rounds
    deadline_failures: int = 0  # heal_failed events naming the read deadline (blocked shards)
    other_heal_failures: int = 0  # heal_failed for any other reason (must be 0)
    asked: int = 0  # requests sent to the daemons during heal rounds
    unanswered: int = 0  # of them: no answer within ANSWER_WITHIN (must be 0)
    slowest: float = 0.0  # the slowest answer, seconds

    def count_requests(self, probing: DaemonProber) -> None:
        """Add a round's requests (a ``testing.daemon_prober.DaemonProber``'s) to the tally."""
        self.asked += probing.asked
        self.unanswered += probing.missed
        self.slowest = max(self.slowest, probing.slowest)


def campaign_daemon(spec: Any, rank: int, log_path: str | None = None) -> None:
    """A model-backed daemon whose reloads write ``RUN/rank{R}.healing`` and then wait
    ``spec``'s delay per layer (the window the campaign kills in)."""
    import os

    from sglang_integration.daemon import checkpoint_reload
    from sglang_integration.testing.model_daemon import run_model_daemon

    delay = float(os.environ.get("HEAL_CAMPAIGN_DELAY", "0.03"))
    marker = Path(spec.path(rank, ".healing"))
    reloader = checkpoint_reload.CheckpointReloader
    real = reloader._reload_layer

    def slowed(self: Any, session: Any, layer: int, experts: Any) -> int:
        marker.write_text("reloading")
        time.sleep(delay)
        return real(self, session, layer, experts)

    reloader._reload_layer = slowed  # type: ignore[method-assign]
    run_model_daemon(spec, rank, log_path)


def _shard_of(checkpoint: Path, layer: int) -> Path:
    """The shard holding ``layer``'s routed experts (the index names it)."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    prefix = f"model.layers.{layer}.mlp.experts.0."
    (file,) = {f for name, f in index["weight_map"].items() if name.startswith(prefix)}
    return checkpoint / str(file)


@contextlib.contextmanager
def _shard_on(kind: str, shard: Path, slow_read: float) -> Iterator[None]:
    """``shard`` on a blocked or slow mount while the block runs (``plain``: as it is)."""
    if kind == "plain":
        yield
        return
    from sglang_integration.testing.stalled_mount import stalled_file

    with stalled_file(shard, kind, slow_read):
        yield


def _heal_failures(ledger: Path, incarnation_id: int) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT reason FROM events WHERE incarnation_id = ? AND kind = 'heal_failed' "
            "ORDER BY event_id",
            (incarnation_id,),
        ).fetchall()
    return [str(reason) for (reason,) in rows]


def _events(ledger: Path, incarnation_id: int) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT kind FROM events WHERE incarnation_id = ? ORDER BY event_id", (incarnation_id,)
        ).fetchall()
    return [str(kind) for (kind,) in rows]


def _right_slots(socket_path: str, checkpoint: Path, the_map: list[list[int]], rank: int) -> int:
    """Local slots whose bytes (the daemon's shared weights, alive or killed) are the
    checkpoint expert ``the_map`` names."""
    from sglang_integration.testing.checkpoint_experts import CheckpointExperts, count_matching
    from sglang_integration.testing.routed_weights import attach_routed_weights

    routed = attach_routed_weights(socket_path)
    held = CheckpointExperts(checkpoint).judge_routed(
        routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
    )
    return count_matching(held, the_map, rank * LOCAL)


def _swap_and_commit(engines: list[Any], sockets: list[str], layer: int, rng: random.Random) -> Any:
    """A real move: on each rank two local slots of ``layer`` trade their bytes, the row
    follows; rank 0's reply to the commit (None: a begin was refused)."""
    from sglang_integration.testing.daemon_control import request
    from sglang_integration.testing.routed_weights import attach_routed_weights

    layout = request(sockets[0], {"type": "expert_layout_query"})["layout"]
    row = list(layout["physical_to_logical_map"][layer])
    for engine in engines:
        if not engine.begin(layout["version"], [layer]).ok:
            return None
    for rank, socket_path in enumerate(sockets):
        a, b = (rank * LOCAL + slot for slot in rng.sample(range(LOCAL), 2))
        routed = attach_routed_weights(socket_path).routed_experts_weights_of_layer
        for tensor in routed[layer]:
            first = tensor[a - rank * LOCAL].clone()
            tensor[a - rank * LOCAL].copy_(tensor[b - rank * LOCAL])
            tensor[b - rank * LOCAL].copy_(first)
        row[a], row[b] = row[b], row[a]
    replies = [engine.commit({layer: row}) for engine in engines]
    return replies[0]


def _spoil(socket_path: str, layers: list[int]) -> None:
    from sglang_integration.testing.routed_weights import attach_routed_weights

    routed = attach_routed_weights(socket_path).routed_experts_weights_of_layer
    for layer in layers:
        for tensor in routed[layer]:
            half = tensor.shape[1] // 2
            tensor[0][:half].copy_(tensor[1][:half])
            tensor[2].zero_()


def run_campaign(
    workdir: Path,
    kills: int,
    *,
    model: str = "qwen3_moe",
    seed: int = 1,
    delay: float = 0.15,
    blocked: float = 0.0,
    slow: float = 0.0,
    slow_read: float = 0.05,
    heal_timeout: float = 1.5,
) -> HealTally:
    import os

    from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
    from sglang_integration.testing.daemon_control import EngineStandIn, request
    from sglang_integration.testing.daemon_prober import DaemonProber
    from sglang_integration.testing.daemons import launch, spec_with_flags
    from sglang_integration.testing.model_daemon import flags_of

    os.environ["HEAL_CAMPAIGN_DELAY"] = str(delay)
    rng = random.Random(seed)
    dtype = "fp8_block" if model == "deepseek_v3" else "bf16"
    checkpoint = write_checkpoint(workdir / "checkpoint", CheckpointSpec(model, dtype, seed))
    spec = spec_with_flags(
        workdir / "run",
        checkpoint,
        flags_of(
            ["--expert-layout-heal", "auto", "--expert-layout-heal-timeout", str(heal_timeout)]
        ),
        ep_size=RANKS,
        num_redundant_experts=REDUNDANT,
        model=model,
    )
    sockets = [spec.path(rank, ".sock") for rank in range(RANKS)]
    ledgers = [Path(spec.path(rank, ".sqlite")) for rank in range(RANKS)]
    markers = [Path(spec.path(rank, ".healing")) for rank in range(RANKS)]
    tally = HealTally()
    group = launch(spec, target=campaign_daemon)
    moe_layers = attach_layers(sockets[0])
    for round_ in range(kills):
        for marker in markers:
            marker.unlink(missing_ok=True)
        acked: dict[int, str] = {}
        engines = [EngineStandIn.start(path, f"engine-{round_}") for path in sockets]
        for _ in range(rng.randint(0, 2)):
            reply = _swap_and_commit(engines, sockets, rng.choice(moe_layers), rng)
            tally.requests += 2 * RANKS
            if reply is not None and reply.ok:
                acked[reply.body["version"]] = reply.body["digest"]
        tally.acknowledged += len(acked)
        kind = "plain"
        if rng.random() < HEAL_ROUNDS:
            layout = request(sockets[0], {"type": "expert_layout_query"})["layout"]
            layers = sorted(rng.sample(moe_layers, rng.randint(1, min(2, len(moe_layers)))))
            draw = rng.random()
            kind = "blocked" if draw < blocked else "slow" if draw < blocked + slow else "plain"
            window = delay * len(layers)
            if kind == "blocked":
                window = 2 * heal_timeout + 0.5  # kills during the blocked read and after it failed
            elif kind == "slow":
                window += 20 * slow_read
            with _shard_on(kind, _shard_of(checkpoint, layers[0]), slow_read):
                probing = DaemonProber(sockets, ("ping", "expert_layout_query"), 0.1, ANSWER_WITHIN)
                with probing:
                    for engine in engines:
                        engine.begin(layout["version"], layers)
                    _spoil(sockets[0], layers)
                    for engine in engines:
                        engine.kill()
                    time.sleep(rng.uniform(0.02, 0.02 + window))
                tally.count_requests(probing)
                reloading = [markers[rank].exists() for rank in range(RANKS)]
                for rank in range(RANKS):
                    group.kill(rank)
        else:
            time.sleep(rng.uniform(0.0, 0.01))
            reloading = [markers[rank].exists() for rank in range(RANKS)]
            for rank in range(RANKS):
                group.kill(rank)
        if kind != "plain":
            tally.shard_rounds[kind] = tally.shard_rounds.get(kind, 0) + 1
        for engine in engines:
            engine.kill()
        for process in group.processes:
            process.join(10)
        for rank in range(RANKS):
            tally.kills += 1
            _check_killed(
                ledgers[rank],
                sockets[rank],
                rank,
                checkpoint=checkpoint,
                acked=acked,
                reloading=reloading[rank],
                tally=tally,
            )
        started = time.monotonic()
        try:
            group = launch(spec, target=campaign_daemon)
        except Exception as exc:  # the restart is what is measured: count it, stop
            tally.start_failures += 1
            tally.problem(f"restart {round_}: {exc}")
            break
        tally.restart_seconds.append(time.monotonic() - started)
        for rank in range(RANKS):
            _check_restarted(ledgers[rank], sockets[rank], rank, checkpoint, tally)
        if tally.kills >= kills:
            break
    group.stop()
    return tally


def _check_killed(
    ledger: Path,
    socket_path: str,
    rank: int,
    *,
    checkpoint: Path,
    acked: dict[int, str],
    reloading: bool,
    tally: HealTally,
) -> None:
    with LedgerReader(ledger) as reader, reader.connect() as conn:
        inc = incarnation(conn)
        i = inc.incarnation_id
        recorded = dict(
            conn.exec_driver_sql(
                "SELECT version, digest FROM versions WHERE incarnation_id = ?", (i,)
            ).all()
        )
    with LedgerReader(ledger) as reader:
        state = reader.state(i)
    lost = [v for v, digest in acked.items() if recorded.get(v) != digest]
    tally.lost += len(lost)
    if lost:
        tally.problem(f"incarnation {i}: acknowledged versions {lost} lost")
    kinds = _events(ledger, i)
    for reason in _heal_failures(ledger, i):
        if "within the deadline of" in reason:
            tally.deadline_failures += 1
        else:
            tally.other_heal_failures += 1
            tally.problem(f"incarnation {i}: heal_failed: {reason[:300]}")
    healed = bool(kinds) and kinds[-1] == "heal"
    if reloading and not healed and "heal_failed" not in kinds[-1:]:
        tally.during_heals += 1
    if healed:
        tally.heals_recorded += 1
    clean = state.dirty is None and state.pending is None
    if clean:
        right = _right_slots(socket_path, checkpoint, state.physical_to_logical_map, rank)
        if right != LOCAL * len(attach_layers(socket_path)):
            tally.wrong_clean += 1
            tally.problem(f"incarnation {i}: clean at the kill with {right} slots right")
    with LedgerReader(ledger) as reader:
        failed = [r for r in verify_incarnation(reader, i) if not r.ok]
    if failed:
        tally.verify_failures += 1
        tally.problem(f"verify: {failed[0].label}: {failed[0].detail}")


def _check_restarted(
    ledger: Path, socket_path: str, rank: int, checkpoint: Path, tally: HealTally
) -> None:
    from sglang_integration.testing.daemon_control import request

    with LedgerReader(ledger) as reader, reader.connect() as conn:
        i = incarnation(conn).incarnation_id
        # The end the restart gave the killed incarnation: never clean.
        end = conn.exec_driver_sql(
            "SELECT end_state FROM incarnations WHERE incarnation_id = ?", (i - 1,)
        ).scalar()
    if end == "clean":
        tally.wrong_states += 1
        tally.problem(f"incarnation {i - 1} ended clean after a SIGKILL")
    _check_restore(ledger, i, tally)
    layout = request(socket_path, {"type": "expert_layout_query"})["layout"]
    right = _right_slots(socket_path, checkpoint, layout["physical_to_logical_map"], rank)
    if layout["dirty"] or layout_digest(layout["physical_to_logical_map"]) != layout["digest"]:
        tally.wrong_states += 1
        tally.problem(f"incarnation {i}: restarted {layout['dirty_reason']}")
    moe = len(attach_layers(socket_path))
    if right != LOCAL * moe:
        tally.wrong_clean += 1
        tally.problem(f"incarnation {i}: restarted clean with {right} of {LOCAL * moe} right")


def attach_layers(socket_path: str) -> list[int]:
    from sglang_integration.testing.routed_weights import attach_routed_weights

    return sorted(attach_routed_weights(socket_path).routed_experts_weights_of_layer)


def render(tally: HealTally, model: str, seconds: float) -> str:
    rows = [
        ("kills (SIGKILL)", f"{tally.kills}"),
        ("  of them during a heal (reloading, not yet recorded)", f"{tally.during_heals}"),
        ("  of them after a heal was recorded", f"{tally.heals_recorded}"),
        ("acknowledged commits", f"{tally.acknowledged}"),
        ("acknowledged commits lost", f"{tally.lost}   (must be 0)"),
        ("clean states with a wrong slot", f"{tally.wrong_clean}   (must be 0)"),
        ("wrong ends or restores", f"{tally.wrong_states}   (must be 0)"),
        ("verify failures", f"{tally.verify_failures}   (must be 0)"),
        ("daemon start failures", f"{tally.start_failures}   (must be 0)"),
        ("heal rounds on a blocked shard", f"{tally.shard_rounds.get('blocked', 0)}"),
        ("heal rounds on a slow shard", f"{tally.shard_rounds.get('slow', 0)}"),
        ("heal_failed at the read deadline", f"{tally.deadline_failures}"),
        ("heal_failed for another reason", f"{tally.other_heal_failures}   (must be 0)"),
        ("requests during heal rounds", f"{tally.asked}"),
        (f"  unanswered within {ANSWER_WITHIN:g} s", f"{tally.unanswered}   (must be 0)"),
        ("  slowest answer", f"{tally.slowest * 1000:.0f} ms"),
    ]
    if tally.restart_seconds:
        rows.append(("restart, median", f"{statistics.median(tally.restart_seconds):.2f} s"))
    width = max(len(label) for label, _ in rows)
    lines = [
        f"Heal campaign: {model}, two model-backed daemons, heal auto; {seconds:.0f} s",
        *(f"  {label:<{width}}  {value}" for label, value in rows),
    ]
    lines += [f"  problem: {text}" for text in tally.problems]
    return "\n".join(lines)


def ok(tally: HealTally) -> bool:
    return not (
        tally.lost
        or tally.wrong_states
        or tally.wrong_clean
        or tally.verify_failures
        or tally.start_failures
        or tally.other_heal_failures
        or tally.unanswered
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=200, help="daemon SIGKILLs (two a round)")
    parser.add_argument("--model", choices=("qwen3_moe", "deepseek_v3"), default="qwen3_moe")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reload-delay", type=float, default=0.15)
    parser.add_argument("--blocked", type=float, default=0.2, help="share of heal rounds")
    parser.add_argument("--slow", type=float, default=0.2, help="share of heal rounds")
    parser.add_argument("--slow-read", type=float, default=0.05, help="seconds per slow read")
    parser.add_argument("--heal-timeout", type=float, default=1.5)
    args = parser.parse_args()
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="heal-campaign-") as workdir:
        tally = run_campaign(
            Path(workdir),
            args.kills,
            model=args.model,
            seed=args.seed,
            delay=args.reload_delay,
            blocked=args.blocked,
            slow=args.slow,
            slow_read=args.slow_read,
            heal_timeout=args.heal_timeout,
        )
    print(render(tally, args.model, time.monotonic() - started))
    return 0 if ok(tally) else 1


if __name__ == "__main__":
    sys.exit(main())
