"""Steps a test engine rank runs after its startup, to drive a standby's forward passes.

Each rank of ``tests/test_engine_startup_hook.EngineRanks`` runs the same steps (a scenario's
``then``). A forward pass is ``standby.around_forward`` (the hook on ``ModelRunner.forward``)
around a stand-in for the original that does what a real forward does across ranks first (a
barrier on the world's gloo group, as the model's collectives would) and then records what this
rank routes with at that moment and whether its daemon lists its lease.

Steps: ``["forward"]`` (``["forward", seconds]``: a batch that lasts ``seconds``, in whose
middle the idle release fires, as the idle thread's would when its check ran just before the
batch began), ``["sleep", seconds]``, ``["wait_released", timeout]`` (until this
rank's idle thread released its lease), ``["forget"]`` (release the lease now and forget the
agreement, as before a first acquisition), ``["release_now"]`` (the idle release, now).
"""

from __future__ import annotations

import time
import types
from typing import Any


def run_steps(steps: list[list[Any]], rank: int, report: dict[str, Any]) -> None:
    from sglang_integration.engine import standby

    gate = standby.current_gate()
    report["forwards"] = report.get("forwards", [])
    report["raised"] = None
    for step in steps:
        kind = step[0]
        if kind == "forward":
            try:
                report["forwards"].append(_forward(gate, float(step[1]) if step[1:] else 0.0))
            except Exception as exc:
                report["raised"] = f"{type(exc).__name__}: {exc}"
                break
        elif kind == "sleep":
            time.sleep(float(step[1]))
        elif kind == "wait_released":
            deadline = time.monotonic() + float(step[1])
            while gate is not None and gate.held and time.monotonic() < deadline:
                time.sleep(0.02)
        elif kind == "forget":
            if gate is not None:
                gate.release_if_idle(now=float("inf"))
                gate.agreed = False
        elif kind == "release_now":
            if gate is not None:
                gate.release_if_idle(now=float("inf"))
        elif kind == "compare_update":
            report["compare_update"] = _compare_update(gate, step[1], step[2])
        else:
            raise ValueError(f"unknown step {step!r}")
    report["gate"] = (
        None
        if gate is None
        else {
            "held": gate.held,
            "agreed": gate.agreed,
            "acquisitions": gate.acquisitions,
            "local_acquisitions": gate.local_acquisitions,
            "prepared_adoptions": gate.prepared_adoptions,
            "releases": gate.releases,
            "version": gate.session.version,
            "digest": gate.session.digest,
        }
    )


def _compare_update(gate: Any, target: list[list[int]], layers: list[int]) -> dict[str, Any]:
    """``copy_layers_in_place`` against sglang's own ``ExpertLocationMetadata.update``: the
    same values in every field, and the same storage as before."""
    import copy

    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.engine.metadata import (
        UPDATED_FIELDS,
        copy_layers_in_place,
        metadata_from_map,
    )

    current = get_global_expert_location_metadata()
    rank = get_parallel().world_group.rank_in_group
    model_config = gate.model_config
    other = metadata_from_map(model_config, target, rank)
    theirs, mine = copy.deepcopy(current), copy.deepcopy(current)
    addresses = [
        getattr(mine, n).data_ptr() for n in UPDATED_FIELDS if getattr(mine, n) is not None
    ]
    theirs.update(other, update_layer_ids=layers)
    copy_layers_in_place(mine, other, layers)
    same = all(
        (getattr(mine, n) is None and getattr(theirs, n) is None)
        or bool((getattr(mine, n) == getattr(theirs, n)).all())
        for n in UPDATED_FIELDS
    )
    kept = addresses == [
        getattr(mine, n).data_ptr() for n in UPDATED_FIELDS if getattr(mine, n) is not None
    ]
    return {"same": same, "kept": kept}


def _forward(gate: Any, lasting: float = 0.0) -> dict[str, Any]:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from sglang_integration.engine import client, standby
    from sglang_integration.engine.metadata import map_of

    seen: dict[str, Any] = {}
    metadata = get_global_expert_location_metadata()
    addresses = _addresses(metadata)

    def original(runner: Any, batch: Any) -> Any:
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        started = time.monotonic()
        dist.barrier(group=get_parallel().world_group.cpu_group)
        seen["barrier_seconds"] = time.monotonic() - started
        if lasting:
            time.sleep(lasting / 2)
            if gate is not None:
                seen["idle_release_mid_batch"] = gate.release_if_idle()
            time.sleep(lasting / 2)
        session = gate.session if gate is not None else None
        seen["map"] = map_of(metadata)
        if session is not None:
            layout = client.query(session.socket_path).layout
            seen["leased"] = layout is not None and session.engine_id in layout.leases
            seen["daemon_version"] = None if layout is None else layout.version
            seen["daemon_map"] = (
                None if layout is None else [list(r) for r in layout.physical_to_logical_map]
            )
        return batch

    runner = types.SimpleNamespace(is_draft_worker=False, eplb_manager=None)
    assert standby.around_forward(original, runner, "batch") == "batch"
    seen["same_addresses"] = _addresses(metadata) == addresses
    return seen


def _addresses(metadata: Any) -> list[int]:
    """The storage addresses of the metadata's tensors (a captured CUDA graph reads these)."""
    from sglang_integration.engine.metadata import UPDATED_FIELDS

    return [
        getattr(metadata, name).data_ptr()
        for name in UPDATED_FIELDS
        if getattr(metadata, name, None) is not None
    ]
