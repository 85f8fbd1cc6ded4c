"""What slot fingerprints cost, at DeepSeek-V3's per-GPU geometry, on CPU tensors.

    .venv/bin/python scripts/bench_fingerprints.py [--repeats N] [--chunk] [--scale K] \
        [--detection N]

One MoE layer of one EP rank of DeepSeek-V3 at EP 8: 288 physical slots (256 routed experts and
32 redundant) / 8 = 36 local slots, each ``w13`` [2 * 2048, 7168] and ``w2`` [7168, 2048] in bf16
(sglang's ``UnquantizedFusedMoEMethod.create_weights``: w13 is [experts, 2 * intermediate,
hidden], w2 [experts, hidden, intermediate], moe_intermediate_size 2048, hidden_size 7168): 88 MB
per slot, 3.17 GB per layer. ``fingerprint_slots`` of that layer (median of ``--repeats``) is
measured next to a memory copy of the same tensors (``dst.copy_(src)``) in the same run. The
cost of one all-layer chunk (the 58 MoE layers 3-60 of DeepSeek-V3's 61,
scripts/deepseek_geometry.py) is 58 times the per-layer cost; ``--chunk`` measures it too, 58
calls over the same layer's tensors (3.17 GB each time, far beyond any cache). ``--scale K``
divides the hidden and intermediate sizes by K (a quick run).

The definition in force (``DISTINCT``: 2048-word chunks, no weight repeated within a chunk) is
measured side by side with the one before it (``FIRST``: 4096-word chunks, 512 distinct weights)
on the same tensors in the same run, alternating, and their ratio printed. ``--detection N``
then swaps two different words of a random slot N times, within one chunk and between two chunks
of a part, and counts the swaps each definition misses (the definition before misses a swap
within a chunk whose words share a weight: about 1 in 512).

The GPU figure is computed from the bytes the fingerprint moves, not measured (no GPU here):
per 4-byte word it reads the word, writes it as a float64 and reads that back for the
matrix-vector product: 5 bytes of traffic per byte of weights, against 2 for a copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepseek_geometry import DEEPSEEK_V3, DEEPSEEK_V3_MOE_LAYERS
from sglang_integration.content import fingerprints as fp
from sglang_integration.content.fingerprints import fingerprint_slots

MOE_LAYERS = len(DEEPSEEK_V3_MOE_LAYERS)  # layers 3-60 hold routed experts
LOCAL_SLOTS = DEEPSEEK_V3.num_physical_slots // 8  # one GPU of EP 8
HIDDEN = 7168
INTERMEDIATE = 2048
# Traffic per byte of weights (module docstring) and an H200's HBM3e bandwidth.
FINGERPRINT_TRAFFIC = 5
COPY_TRAFFIC = 2
H200_BYTES_PER_SECOND = 4.8e12


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="per-layer runs (median)")
    parser.add_argument("--chunk", action="store_true", help="measure the 58-layer chunk too")
    parser.add_argument("--scale", type=int, default=1, help="divide the sizes by this")
    parser.add_argument(
        "--detection", type=int, default=2000, metavar="N", help="random swaps to count (0: none)"
    )
    return parser.parse_args(argv)


def layer_tensors(scale: int) -> list[torch.Tensor]:
    """One layer's w13 and w2, every page written (slot i holds the value i + 1)."""
    hidden, intermediate = HIDDEN // scale, INTERMEDIATE // scale
    w13 = torch.empty((LOCAL_SLOTS, 2 * intermediate, hidden), dtype=torch.bfloat16)
    w2 = torch.empty((LOCAL_SLOTS, hidden, intermediate), dtype=torch.bfloat16)
    for tensor in (w13, w2):
        for slot in range(LOCAL_SLOTS):
            tensor[slot].view(torch.int16).fill_(slot + 1)
    return [w13, w2]


def timed(action: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` runs, after one warm-up run."""
    action()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tensors = layer_tensors(args.scale)
    targets = [torch.empty_like(tensor) for tensor in tensors]
    layer_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def fingerprint() -> None:
        fingerprint_slots(tensors, LOCAL_SLOTS)

    def copy() -> None:
        for target, tensor in zip(targets, tensors, strict=True):
            target.copy_(tensor)

    print(
        f"Slot fingerprints, DeepSeek-V3 geometry: {LOCAL_SLOTS} local slots per layer (EP 8), "
        f"w13 {list(tensors[0].shape)} + w2 {list(tensors[1].shape)} bf16 = "
        f"{layer_bytes / 1e9:.2f} GB per layer; CPU, {torch.get_num_threads()} threads"
    )

    def fingerprint_first() -> None:
        fingerprint_slots(tensors, LOCAL_SLOTS, definition=fp.FIRST)

    seconds, first_seconds = timed_pair(fingerprint, fingerprint_first, args.repeats)
    copy_seconds = timed(copy, args.repeats)
    print(f"\n(a) one layer, median of {args.repeats}")
    _row("fingerprint_slots", seconds, layer_bytes)
    _row("the definition before (4096, 512 weights)", first_seconds, layer_bytes)
    _row("memory copy of the same tensors", copy_seconds, layer_bytes)
    print(f"    fingerprint / copy:  {seconds / copy_seconds:.2f}")
    print(f"    fingerprint / the definition before:  {seconds / first_seconds:.2f} (target 1.2)")
    _chunk(
        args,
        seconds=seconds,
        copy_seconds=copy_seconds,
        layer_bytes=layer_bytes,
        fingerprint=fingerprint,
        copy=copy,
    )
    _gpu_estimate(layer_bytes)
    if args.detection:
        _detection(args.detection)
    return 0


def timed_pair(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median seconds of each of two actions, run alternately, each first every other time
    (the same load on both, and no advantage from the order)."""
    first()
    second()
    runs: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        order = ((first, runs[0]), (second, runs[1]))
        for action, found in order if repeat % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            action()
            found.append(time.perf_counter() - started)
    return statistics.median(runs[0]), statistics.median(runs[1])


def _detection(trials: int) -> None:
    """Random swaps of two different int32 words, within a chunk and between two chunks of a
    part (eight 4096-word spans per part, so both definitions have several chunks)."""
    generator = torch.Generator().manual_seed(20)
    span = 8 * fp.FIRST.chunk_words
    base = torch.randint(-(2**31), 2**31 - 1, (fp.PARTS * span,), generator=generator)
    base = base.to(torch.int32)
    print(f"\n(d) {trials} random swaps of two different words in one part, each definition:")
    for where in ("within a chunk", "between chunks"):
        pairs = _pairs(base, trials, where, generator)
        missed = {}
        for definition in (fp.DISTINCT, fp.FIRST):
            chunk = definition.chunk_words
            kept = [(i, j) for i, j in pairs if (i // chunk == j // chunk) == (where[0] == "w")]
            slots = base.repeat(len(kept) + 1, 1)
            for n, (i, j) in enumerate(kept):
                slots[n + 1, i], slots[n + 1, j] = base[j], base[i]
            prints = fingerprint_slots([slots], slots.shape[0], definition=definition)
            missed[definition.name] = (int((prints[1:] == prints[0]).all(dim=1).sum()), len(kept))
        shown = "; ".join(f"{name}: {m} of {n} missed" for name, (m, n) in missed.items())
        print(f"    {where:<16} {shown}")


def _pairs(
    base: torch.Tensor, trials: int, where: str, generator: torch.Generator
) -> list[tuple[int, int]]:
    span = base.shape[0] // fp.PARTS
    chunk = fp.DISTINCT.chunk_words
    pairs: list[tuple[int, int]] = []
    while len(pairs) < trials:
        i = int(torch.randint(0, span, (1,), generator=generator))
        if where.startswith("within"):
            j = i // chunk * chunk + int(torch.randint(0, chunk, (1,), generator=generator))
        else:
            j = int(torch.randint(0, span, (1,), generator=generator))
            if j // fp.FIRST.chunk_words == i // fp.FIRST.chunk_words:
                continue
        if base[i] != base[j]:
            pairs.append((i, j))
    return pairs


def _row(what: str, seconds: float, num_bytes: float) -> None:
    print(f"    {what:<40} {seconds * 1e3:10.1f} ms  {num_bytes / seconds / 1e9:6.2f} GB/s read")


def _chunk(
    args: argparse.Namespace,
    *,
    seconds: float,
    copy_seconds: float,
    layer_bytes: int,
    fingerprint: Callable[[], None],
    copy: Callable[[], None],
) -> None:
    chunk_bytes = MOE_LAYERS * layer_bytes
    if args.chunk:
        print(
            f"\n(b) one all-layer chunk: {MOE_LAYERS} layers measured ({chunk_bytes / 1e9:.0f} GB)"
        )
        started = time.perf_counter()
        for _ in range(MOE_LAYERS):
            fingerprint()
        seconds_all = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(MOE_LAYERS):
            copy()
        copy_all = time.perf_counter() - started
    else:
        print(
            f"\n(b) one all-layer chunk: {MOE_LAYERS} x (a) ({chunk_bytes / 1e9:.0f} GB; "
            f"--chunk measures it)"
        )
        seconds_all, copy_all = MOE_LAYERS * seconds, MOE_LAYERS * copy_seconds
    _row("fingerprint_slots", seconds_all, chunk_bytes)
    _row("memory copy of the same tensors", copy_all, chunk_bytes)


def _gpu_estimate(layer_bytes: int) -> None:
    per_layer = FINGERPRINT_TRAFFIC * layer_bytes / H200_BYTES_PER_SECOND
    copy_layer = COPY_TRAFFIC * layer_bytes / H200_BYTES_PER_SECOND
    print(
        f"\n(c) on a GPU, by the bytes it moves (not measured here): {FINGERPRINT_TRAFFIC} bytes "
        f"of traffic per byte of weights (read, float64 written and read back), a copy "
        f"{COPY_TRAFFIC}; at an H200's {H200_BYTES_PER_SECOND / 1e12:.1f} TB/s:"
    )
    print(
        f"    per layer {per_layer * 1e3:.1f} ms (copy {copy_layer * 1e3:.1f} ms); per all-layer "
        f"chunk {MOE_LAYERS * per_layer * 1e3:.0f} ms (copy {MOE_LAYERS * copy_layer * 1e3:.0f} ms)"
    )


if __name__ == "__main__":
    sys.exit(main())
