"""Slot fingerprints on real CUDA tensors: the demo's content checks, on a GPU.

    .venv/bin/python scripts/gpu_fingerprints.py [--device cuda] [--scale K]

PREPARED, NOT RUN: the session that wrote it had no GPU. It needs torch with CUDA and this
package; with ``--device cpu`` it runs the same checks on the CPU (the tests do, at ``--scale``).

One MoE layer of one EP rank at DeepSeek-V3's geometry (36 local slots: 32 experts and replicas
of experts 0-3 in slots 32-35; w13 [36, 4096, 7168] and w2 [36, 7168, 2048] in bf16, 3.17 GB),
random bytes made on the device:

1. the same fingerprints on the device and on the CPU (a copy of the layer made here for this
   comparison only), and on the device twice;
2. replicas equal their twins, and the 32 experts are 32 different fingerprints;
3. damage on the device: half of slot 10 (the first half of its bytes) overwritten with slot
   11's, and the replica in slot 35 zeroed: slot 10 reads "partial: parts 0-1 of expert 11,
   parts 2-3 of expert 10", slot 35 "zero-filled", every other slot unchanged;
4. a daemon's record on those tensors (``LayoutRecord`` in memory with the fingerprints at
   version 0, ``ModelSlots`` as its content source): the load check passes before the damage,
   and the content check after it marks the record dirty naming slots 10 and 35;
5. time per layer (median of 5) next to a device copy of the same bytes.

Exit 0 when every check holds, 1 when one does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layout_ledger.core.content import ExpertContents
from layout_ledger.core.layout import Geometry
from layout_ledger.core.record import LayoutRecord
from sglang_integration.content.fingerprints import fingerprint_hex, fingerprint_slots
from sglang_integration.content.model_slots import ModelSlots

SLOTS, EXPERTS, REPLICAS = 36, 32, 4
TORN, ZEROED = 10, 35


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=int, default=1, help="divide hidden and intermediate")
    return parser.parse_args(argv)


def make_layer(device: str, scale: int) -> list[torch.Tensor]:
    hidden, intermediate = 7168 // scale, 2048 // scale
    generator = torch.Generator(device=device).manual_seed(7)
    tensors = []
    for shape in ((2 * intermediate, hidden), (hidden, intermediate)):
        bits = torch.randint(
            -(2**15), 2**15, (SLOTS, *shape), dtype=torch.int16, device=device, generator=generator
        )
        tensor = bits.view(torch.bfloat16)
        tensor[EXPERTS:] = tensor[:REPLICAS]  # slots 32-35 replicate experts 0-3
        tensors.append(tensor)
    return tensors


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(action: Any, device: str, repeats: int = 5) -> float:
    action()
    synchronize(device)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        synchronize(device)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tensors = make_layer(args.device, args.scale)
    layer_bytes = sum(t.numel() * t.element_size() for t in tensors)
    checks: list[tuple[str, bool]] = []
    before = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    on_cpu = fingerprint_hex(fingerprint_slots([t.cpu() for t in tensors], SLOTS))
    checks.append(("the same fingerprints on the device and on the CPU", before == on_cpu))
    again = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    checks.append(("the same fingerprints twice on the device", again == before))
    twins = all(before[EXPERTS + i] == before[i] for i in range(REPLICAS))
    checks.append(("replicas equal their twins", twins))
    checks.append(("32 experts, 32 different fingerprints", len(set(before[:EXPERTS])) == EXPERTS))
    record, slots = _record(tensors)
    checks.append(("the load check passes", record.check_loaded_content() is None))
    _damage(tensors)
    after = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    checks += _damage_checks(before, after)
    view = record.content_check(slots.fingerprints)
    named = (
        view.dirty
        and "slot 10:" in (view.dirty_reason or "")
        and "slot 35:" in (view.dirty_reason or "")
    )
    checks.append(("the content check marks the record dirty, naming slots 10 and 35", named))
    seconds = timed(lambda: fingerprint_slots(tensors, SLOTS), args.device)
    target = [torch.empty_like(t) for t in tensors]
    copy = timed(lambda: [d.copy_(s) for d, s in zip(target, tensors, strict=True)], args.device)
    for what, ok in checks:
        print(f"{'ok    ' if ok else 'FAILED'}  {what}")
    print(
        f"one layer ({layer_bytes / 1e6:.1f} MB) on {args.device}: fingerprint "
        f"{seconds * 1e3:.1f} ms ({layer_bytes / seconds / 1e9:.0f} GB/s read), copy "
        f"{copy * 1e3:.1f} ms; 58 layers: {58 * seconds * 1e3:.0f} ms"
    )
    return 0 if all(ok for _, ok in checks) else 1


def _record(tensors: list[torch.Tensor]) -> tuple[LayoutRecord, ModelSlots]:
    """A daemon's record at version 0 of this layer (layer 0 of a 1-layer, 36-slot model)."""
    slots = ModelSlots(lambda: {0: tensors}, 0, SLOTS)
    row = [*range(EXPERTS), *range(REPLICAS)]
    record = LayoutRecord.in_memory(
        Geometry(1, SLOTS, EXPERTS), [row], content=slots.fingerprints()
    )
    return record, slots


def _damage(tensors: list[torch.Tensor]) -> None:
    """The first half of slot 10's bytes (all in w13) become slot 11's; slot 35 is zeroed."""
    words = tensors[0].view(SLOTS, -1)
    total = sum(t[0].numel() for t in tensors)
    words[TORN, : total // 2] = words[TORN + 1, : total // 2]
    for tensor in tensors:
        tensor[ZEROED].zero_()


def _damage_checks(before: list[str], after: list[str]) -> list[tuple[str, bool]]:
    known = ExpertContents()
    row = [*range(EXPERTS), *range(REPLICAS)]
    for slot, fingerprint in enumerate(before):
        known.learn(0, row[slot], fingerprint, f"slot {slot}")
    torn = known.identify(0, after[TORN]).text
    zeroed = known.identify(0, after[ZEROED]).text
    unchanged = all(after[s] == before[s] for s in range(SLOTS) if s not in (TORN, ZEROED))
    return [
        (
            "slot 10 reads partial: parts 0-1 of expert 11, parts 2-3 of expert 10",
            torn == "partial: parts 0-1 of expert 11, parts 2-3 of expert 10",
        ),
        ("slot 35 reads zero-filled", zeroed == "zero-filled"),
        ("every other slot keeps its fingerprint", unchanged),
    ]


if __name__ == "__main__":
    sys.exit(main())
