"""Stage 2: every slot fingerprinted on the device, at DeepSeek-V3's per-GPU scale.

Runs only when this package provides ``sglang_integration.content.fingerprints.fingerprint_slots``
(content-verified layouts, another piece of work); until then the stage reports
``skipped: fingerprints not available in this version``. The function it is written against:

    fingerprint_slots(tensors: list[torch.Tensor], num_slots: int) -> torch.Tensor

one fingerprint per physical slot of one layer (first dimension ``num_slots``), computed on the
tensors' device from the bytes of that slot in every tensor.

In a child process (its device memory is freed when it exits): measure the device's copy
bandwidth (``dst.copy_(src)``, bytes read + written per second); allocate the 58 MoE layers of
the 36 local slots of EP rank 0 (32 experts and 4 replicas of experts 0-3 on this GPU, so a
replica's fingerprint can be compared with its twin's), fill them (``expert_bytes``);
fingerprint every layer once to warm up, then every layer timed; then damage one layer, half
of one slot overwritten with its neighbour's bytes and one replica zeroed, and fingerprint that
layer again.
"""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from gpu_single.expert_bytes import bases_for, fill_layer, slot_words, synchronize
from gpu_single.geometry import deepseek_v3_geometry, human_bytes
from gpu_single.results import Stage

FINGERPRINT_MODULE = "sglang_integration.content.fingerprints"
FINGERPRINT_FUNCTION = "fingerprint_slots"
NOT_AVAILABLE = "skipped: fingerprints not available in this version"
REPLICAS = 4  # local slots 32..35 replicate experts 0..3
TORN_SLOT = 10
ZEROED_REPLICA_OFFSET = 3  # the replica of expert 3, in the last local slot

FingerprintFunction = Callable[[list[torch.Tensor], int], torch.Tensor]


def find_fingerprint_function() -> FingerprintFunction | None:
    """``fingerprint_slots`` when this version provides it, else None."""
    try:
        module = importlib.import_module(FINGERPRINT_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != FINGERPRINT_MODULE:
            raise
        return None
    function: FingerprintFunction | None = getattr(module, FINGERPRINT_FUNCTION, None)
    return function


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` on the device."""
    source = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    seconds = time.perf_counter() - started
    del source, target
    return 2 * num_bytes * repeats / seconds


def rows_of(fingerprints: torch.Tensor, num_slots: int) -> list[tuple[Any, ...]]:
    """Each slot's fingerprint as a hashable tuple (copied to the host once)."""
    if fingerprints.shape[0] != num_slots:
        raise ValueError(f"{fingerprints.shape[0]} fingerprints for {num_slots} slots")
    host = fingerprints.reshape(num_slots, -1).cpu()
    return [tuple(row.tolist()) for row in host]


def allocate_layers(num_layers: int, scale: int, device: str) -> tuple[Any, list[Any]]:
    geometry = deepseek_v3_geometry(num_layers, scale)
    slots = geometry.num_local_slots
    contents = [*range(slots - REPLICAS), *range(REPLICAS)]
    layers = [
        [
            torch.empty((slots, *spec.slot_shape), dtype=getattr(torch, spec.dtype), device=device)
            for spec in geometry.tensors
        ]
        for _ in range(num_layers)
    ]
    bases = bases_for(layers[0])
    for layer, tensors in enumerate(layers):
        fill_layer(tensors, layer, contents, bases)
    synchronize(device)
    return geometry, layers


def damage(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """Overwrite the second half of ``TORN_SLOT``'s first tensor with its neighbour's bytes and
    zero the last slot (a replica) in every tensor; the two slots."""
    words = slot_words(tensors[0])
    half = words.shape[1] // 2
    words[TORN_SLOT, half:] = words[TORN_SLOT + 1, half:]
    replica = words.shape[0] - REPLICAS + ZEROED_REPLICA_OFFSET
    for tensor in tensors:
        slot_words(tensor)[replica].zero_()
    return TORN_SLOT, replica


def measure_fingerprints(
    device: str,
    num_layers: int,
    scale: int,
    copy_bytes: int,
    function: FingerprintFunction | None = None,
) -> dict[str, Any]:
    fingerprint = function or find_fingerprint_function()
    if fingerprint is None:
        raise RuntimeError(f"{FINGERPRINT_MODULE}.{FINGERPRINT_FUNCTION} is not available")
    copy_rate = copy_bandwidth(device, copy_bytes)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    geometry, layers = allocate_layers(num_layers, scale, device)
    slots = geometry.num_local_slots
    fingerprint(list(layers[0]), slots)
    synchronize(device)
    started = time.perf_counter()
    results = [fingerprint(list(tensors), slots) for tensors in layers]
    synchronize(device)
    seconds = time.perf_counter() - started
    rows = [rows_of(result, slots) for result in results]
    again = rows_of(fingerprint(list(layers[0]), slots), slots)
    middle = num_layers // 2
    torn, zeroed = damage(layers[middle])
    after = rows_of(fingerprint(list(layers[middle]), slots), slots)
    twin = zeroed - (slots - REPLICAS)
    return {
        "geometry": geometry.description,
        "bytes": geometry.total_bytes,
        "seconds": seconds,
        "copy_rate": copy_rate,
        "copy_bytes": copy_bytes,
        "shape_ok": all(result.shape[0] == slots for result in results),
        "repeatable": again == rows[0],
        "replicas_equal": sum(
            row[slots - REPLICAS + i] == row[i] for row in rows for i in range(REPLICAS)
        ),
        "replicas": num_layers * REPLICAS,
        "distinct": sum(len(set(row[: slots - REPLICAS])) == slots - REPLICAS for row in rows),
        "layers": num_layers,
        "torn_detected": after[torn] != rows[middle][torn],
        "zeroed_detected": after[zeroed] != after[twin] and after[zeroed] != rows[middle][zeroed],
        "others_unchanged": all(
            after[s] == rows[middle][s] for s in range(slots) if s not in (torn, zeroed)
        ),
    }


def run_measurement(
    device: str, num_layers: int, scale: int, copy_bytes: int, channel: Connection
) -> None:
    """Process target: ``measure_fingerprints``, its result or the error on the pipe."""
    try:
        channel.send(
            {"event": "report", **measure_fingerprints(device, num_layers, scale, copy_bytes)}
        )
    except Exception:
        channel.send({"event": "error", "error": traceback.format_exc()})


def fingerprint_rows(stage: Stage, report: dict[str, Any]) -> None:
    layers = report["layers"]
    stage.info("slots fingerprinted", report["geometry"])
    rate = report["bytes"] / report["seconds"]
    stage.info(
        "bytes read, time, rate (every layer, one call per layer)",
        f"{human_bytes(report['bytes'])}, {report['seconds'] * 1e3:.1f} ms, {rate / 1e9:.1f} GB/s",
    )
    stage.info(
        "device copy bandwidth, same run (read + written)",
        f"{report['copy_rate'] / 1e9:.1f} GB/s ({human_bytes(report['copy_bytes'])} copies); "
        f"fingerprint read rate = {rate / report['copy_rate']:.2f} x",
    )
    stage.check(
        "one fingerprint per slot, every layer",
        "yes",
        "yes" if report["shape_ok"] else "no",
        report["shape_ok"],
    )
    stage.check(
        "the same bytes give the same fingerprints (layer 0 twice)",
        "yes",
        "yes" if report["repeatable"] else "no",
        report["repeatable"],
    )
    stage.check(
        "replicas' fingerprints equal their twins'",
        f"{report['replicas']}/{report['replicas']}",
        f"{report['replicas_equal']}/{report['replicas']}",
        report["replicas_equal"] == report["replicas"],
    )
    stage.check(
        "layers whose 32 distinct experts have 32 distinct fingerprints",
        f"{layers}/{layers}",
        f"{report['distinct']}/{layers}",
        report["distinct"] == layers,
    )
    stage.check(
        "a half-overwritten slot detected",
        "yes",
        "yes" if report["torn_detected"] else "no",
        report["torn_detected"],
    )
    stage.check(
        "a zeroed replica detected (differs from its twin)",
        "yes",
        "yes" if report["zeroed_detected"] else "no",
        report["zeroed_detected"],
    )
    stage.check(
        "the layer's other slots keep their fingerprints",
        "yes",
        "yes" if report["others_unchanged"] else "no",
        report["others_unchanged"],
    )
