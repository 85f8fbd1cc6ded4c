"""The holder: the process that owns the expert tensors, standing in for the weight cache
daemon's model (the model-less daemons hold no tensors).

It allocates every geometry's tensors on the device, writes into every slot the expert the
daemons' initial (trivial) layout names there, and serializes the tensors with torch's own IPC
reductions (``ForkingPickler``, as sglang's ``MultiprocessingSerializer`` does):

- on CUDA each tensor becomes a CUDA IPC memory handle (``rebuild_cuda_tensor``), serialized
  once; every engine gets the same bytes, as sglang's daemon serves every engine the handles it
  serialized at load (``TorchIpcTransportBackend.prepare_export``);
- on the CPU, with torch's ``file_system`` sharing strategy, a shared-memory file
  (``rebuild_storage_filename``). Such a pickle holds one reference to the file, which the one
  process that rebuilds it takes over, so the holder serializes again for every engine.

It keeps the tensors alive until told to exit, and reads its own view of them when asked.

Commands on the pipe: ``("share", None)`` -> ``{"event": "handles", "blob": ..., ...}`` (the
handles for the next engine); ``("read", None)`` -> ``{"event": "held", "held": {geometry:
map}}``; ``("exit", None)``.
"""

from __future__ import annotations

import os
import pickletools
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch import multiprocessing as torch_multiprocessing

from gpu_single.expert_bytes import bases_for, fill_layer, held_experts, synchronize
from gpu_single.geometry import ExpertGeometry

Tensors = dict[str, list[torch.Tensor]]


def allocate(geometry: ExpertGeometry, device: str) -> list[torch.Tensor]:
    """One tensor per expert tensor spec: ``[layers, local slots, *slot_shape]``."""
    return [
        torch.empty(
            (geometry.num_layers, geometry.num_local_slots, *spec.slot_shape),
            dtype=getattr(torch, spec.dtype),
            device=device,
        )
        for spec in geometry.tensors
    ]


def fill_initial(geometry: ExpertGeometry, tensors: Sequence[torch.Tensor]) -> None:
    rows = geometry.local_rows(geometry.initial_map())
    bases = bases_for([t[0] for t in tensors])
    for layer in range(geometry.num_layers):
        fill_layer([t[layer] for t in tensors], layer, rows[layer], bases)


def read_held(geometry: ExpertGeometry, tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Per layer and local slot, the expert this process reads there."""
    bases = bases_for([t[0] for t in tensors])
    return [
        held_experts([t[layer] for t in tensors], layer, geometry.num_logical_experts, bases)
        for layer in range(geometry.num_layers)
    ]


def rebuild_functions(blob: bytes) -> list[str]:
    """The torch rebuild functions the serialized handles name (what an engine runs on them)."""
    names = {
        str(arg)
        for opcode, arg, _ in pickletools.genops(blob)
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE")
        and str(arg).startswith("rebuild_")
    }
    return sorted(names)


class Handles:
    """The serialized IPC handles for the next engine (see the module docstring)."""

    def __init__(self, tensors: Tensors, device: str) -> None:
        self.tensors = tensors
        self.cuda = torch.device(device).type == "cuda"
        if not self.cuda:
            torch_multiprocessing.set_sharing_strategy("file_system")
        self._once: bytes | None = None

    def for_next_engine(self) -> bytes:
        if not self.cuda:
            return bytes(ForkingPickler.dumps(self.tensors))
        if self._once is None:
            self._once = bytes(ForkingPickler.dumps(self.tensors))
        return self._once


def check_allocator() -> None:
    """sglang's daemon refuses expandable segments: their memory has no CUDA IPC handle."""
    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(variable, "").replace(" ", "").lower():
            raise RuntimeError(f"{variable} sets expandable_segments:True: no CUDA IPC export")


def run_holder(device: str, geometries: Sequence[ExpertGeometry], channel: Connection) -> None:
    """Process target (see the module docstring)."""
    try:
        check_allocator()
        started = time.monotonic()
        tensors: Tensors = {}
        for geometry in geometries:
            tensors[geometry.name] = allocate(geometry, device)
            fill_initial(geometry, tensors[geometry.name])
        synchronize(device)
        handles = Handles(tensors, device)
        blob = handles.for_next_engine()
        channel.send(
            {
                "event": "ready",
                "handles_bytes": len(blob),
                "rebuild": rebuild_functions(blob),
                "seconds": time.monotonic() - started,
                "device_name": device_name(device),
            }
        )
    except Exception:
        channel.send({"event": "error", "error": traceback.format_exc()})
        return
    _obey(geometries, tensors, handles, blob, channel)


def _obey(
    geometries: Sequence[ExpertGeometry],
    tensors: Tensors,
    handles: Handles,
    first: bytes | None,
    channel: Connection,
) -> None:
    while True:
        try:
            verb, _ = channel.recv()
        except EOFError:
            return
        if verb == "exit":
            return
        try:
            if verb == "share":
                blob, first = (first if first is not None else handles.for_next_engine()), None
                reply: dict[str, Any] = {"event": "handles", "blob": blob}
            else:
                held = {g.name: read_held(g, tensors[g.name]) for g in geometries}
                reply = {"event": "held", "held": held}
        except Exception:
            reply = {"event": "error", "error": traceback.format_exc()}
        channel.send(reply)


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return str(torch.cuda.get_device_name(torch.device(device)))
    return "cpu"
