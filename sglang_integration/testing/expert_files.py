"""Expert tensors in files: what the model-less daemon serves with ``--experts DIR``.

A model-less daemon has no model, so no routed-expert tensors to fingerprint. With ``--experts
DIR --expert-rank R`` it maps the files below, the CPU stand-in for the CUDA-IPC tensors a real
daemon exports, which engines on the same machine map too (an in-place move by one is seen by
all). The format (version 1), written by the test harness
(``sglang_integration/testing/shared_experts.py``) and read here; this module reads nothing else:

- ``DIR/rank{R}.json``: ``{"format_version": 1, "num_layers": L, "num_logical_experts": E,
  "num_physical_slots": P, "ep_size": N, "widths": [w_0, w_1, ...]}``; EP rank ``R`` holds the
  ``P / N`` physical slots from ``R * P / N`` on. Written last, so its presence means the data
  file is complete.
- ``DIR/rank{R}.experts``: float32, native byte order; for each tensor ``t`` in order a block of
  shape ``(L, P / N, w_t)``, the blocks back to back. Layer ``l``'s routed-expert tensors (what
  sglang's ``routed_experts_weights_of_layer[l]`` is in a model) are the blocks' ``[l]`` views.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.layout import Geometry
from sglang_integration.content.model_slots import ModelSlots

FORMAT_VERSION = 1


class ExpertFilesError(Exception):
    """The expert files are missing, incomplete, or do not fit the daemon's geometry."""


@dataclass(frozen=True)
class ExpertFileShape:
    num_layers: int
    num_logical_experts: int
    num_physical_slots: int
    ep_size: int
    widths: tuple[int, ...]

    @property
    def num_local_slots(self) -> int:
        return self.num_physical_slots // self.ep_size


def read_shape(directory: str | Path, rank: int) -> ExpertFileShape:
    path = Path(directory) / f"rank{rank}.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExpertFilesError(f"{path} does not exist: no expert files of rank {rank}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ExpertFilesError(
            f"{path} has format version {meta.get('format_version')!r}; this daemon reads "
            f"{FORMAT_VERSION}"
        )
    try:
        return ExpertFileShape(
            int(meta["num_layers"]),
            int(meta["num_logical_experts"]),
            int(meta["num_physical_slots"]),
            int(meta["ep_size"]),
            tuple(int(width) for width in meta["widths"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ExpertFilesError(f"{path} is not an expert file shape: {exc}") from exc


def map_expert_files(directory: str | Path, rank: int) -> tuple[ExpertFileShape, dict[int, Any]]:
    """Rank ``rank``'s tensors, mapped shared: ``{layer: [tensor per width]}``."""
    import torch

    shape = read_shape(directory, rank)
    if not 0 <= rank < shape.ep_size or shape.num_physical_slots % shape.ep_size:
        raise ExpertFilesError(f"rank {rank} does not fit the expert files' shape {shape}")
    local = shape.num_local_slots
    numel = sum(shape.num_layers * local * width for width in shape.widths)
    path = Path(directory) / f"rank{rank}.experts"
    if not path.is_file() or path.stat().st_size != numel * 4:
        raise ExpertFilesError(f"{path} is missing or not {numel * 4} bytes")
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
    blocks, offset = [], 0
    for width in shape.widths:
        size = shape.num_layers * local * width
        blocks.append(flat[offset : offset + size].view(shape.num_layers, local, width))
        offset += size
    return shape, {layer: [block[layer] for block in blocks] for layer in range(shape.num_layers)}


def expert_file_slots(directory: str | Path, rank: int, geometry: Geometry) -> ModelSlots:
    """Rank ``rank``'s local slots as a content source, checked against the daemon's geometry."""
    shape, routed = map_expert_files(directory, rank)
    if (shape.num_layers, shape.num_physical_slots, shape.num_logical_experts) != (
        geometry.num_layers,
        geometry.num_physical_slots,
        geometry.num_logical_experts,
    ):
        raise ExpertFilesError(
            f"the expert files in {directory} are {shape.num_layers} layers x "
            f"{shape.num_physical_slots} slots / {shape.num_logical_experts} experts, the daemon "
            f"{geometry.num_layers} x {geometry.num_physical_slots} / "
            f"{geometry.num_logical_experts}"
        )
    return ModelSlots(lambda: routed, rank * shape.num_local_slots, shape.num_local_slots)


GATE_TIMEOUT = 60.0


class GatedSlots:
    """``slots`` with a test's hook point (the model-less daemon's ``--fingerprint-gate DIR``).

    Each fingerprinting of every slot (``layers`` None: a content check's, a repair's; a
    commit's of its layers is not gated) reads the slots, writes ``DIR/read-N`` (N = 1, 2, ...)
    and waits for ``DIR/go-N`` (at most ``GATE_TIMEOUT`` s) before it returns what it read, so a
    test can run a begin, a move and a commit between the read and the daemon's comparison.
    """

    def __init__(self, slots: ModelSlots, directory: str | Path) -> None:
        self._slots = slots
        self._directory = Path(directory)
        self._count = 0
        self.first_slot = slots.first_slot
        self.num_slots = slots.num_slots

    def fingerprints(self, layers: Sequence[int] | None = None) -> LocalFingerprints:
        found = self._slots.fingerprints(layers)
        if layers is not None:
            return found
        self._count += 1
        (self._directory / f"read-{self._count}").touch()
        go = self._directory / f"go-{self._count}"
        deadline = time.monotonic() + GATE_TIMEOUT
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return found
