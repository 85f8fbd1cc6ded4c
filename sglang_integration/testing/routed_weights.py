"""A loaded model's routed-expert parameters in shared-memory files: exported by a model-backed
daemon, mapped by every engine on it.

With the weight cache, an engine's parameters are the daemon's tensors, mapped zero-copy through
CUDA IPC, so an in-place move by one engine changes the bytes under the daemon and under every
other engine on it. On a CPU a file mapped ``MAP_SHARED`` by several processes
(``torch.from_file(shared=True)``) does the same. ``export_routed_weights`` (the daemon, in place
of sglang's CUDA IPC export) moves every routed-expert parameter of the loaded model into one such
file, *as the parameter's own storage* (``param.data``), so the daemon's later in-place writes (a
reload of some experts through sglang's loader) and every engine's moves land in the same bytes;
``attach_routed_weights`` (an engine rank, a test) maps them back as the model's
``routed_experts_weights_of_layer``.

Files of a daemon whose socket is ``RUN/rank0.sock`` (format version 1):

- ``RUN/rank0.routed``: the parameters' bytes, each at an offset aligned to 64 bytes;
- ``RUN/rank0.routed.json``: ``{"format_version": 1, "pid": ..., "data_file": "rank0.routed",
  "size": bytes, "first_slot": F, "num_local_slots": S, "layers": {"L": [{"name":
  "w13_weight", "dtype": "bfloat16", "shape": [S, ...], "offset": bytes}, ...]}}``: per MoE
  layer, sglang's ``routed_experts_weights_of_layer[L]`` in order, each tensor by its parameter
  name. Written last (renamed into place), so its presence means the data file is complete.

A restarted daemon writes new files and renames them into place: engines that mapped the old
ones keep the old bytes, as engines on a restarted GPU daemon would (new memory). What an
engine reads from the manifest is checked before it maps anything (a file it did not create).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_integration.content.model_slots import routed_mapping
from sglang_integration.testing.model_errors import SharedWeightsError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIGNMENT = 64
DATA_SUFFIX = ".routed"
MANIFEST_SUFFIX = ".routed.json"
# The dtypes a routed-expert parameter has in the toolkit's checkpoints (and their names).
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "uint8", "int32")
MAX_MANIFEST_BYTES = 1 << 20


def manifest_path(socket_path: str | os.PathLike[str]) -> Path:
    """``RUN/rank0.routed.json`` for the daemon serving ``RUN/rank0.sock``."""
    path = Path(socket_path)
    return path.with_name(path.stem + MANIFEST_SUFFIX)


@dataclass(frozen=True)
class RoutedTensor:
    """One tensor of a layer's ``routed_experts_weights_of_layer``, where it lies in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class RoutedManifest:
    """What a manifest says (checked: every tensor lies inside the data file)."""

    data_file: str
    size: int
    pid: int
    first_slot: int
    num_local_slots: int
    layers: dict[int, tuple[RoutedTensor, ...]]


# --- the daemon's side ---------------------------------------------------------------------------


def routed_parameters(model: Any) -> list[tuple[int, str, Any]]:
    """``(layer id, name, parameter)`` of every FusedMoE parameter with a slot dimension first.

    The superset of what the model's ``get_moe_weights`` hands sglang's updater (those with
    ``num_local_experts`` rows); ``export_routed_weights`` then checks that every tensor of
    ``routed_experts_weights_of_layer`` lies in the file.
    """
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    found = []
    for module in model.modules():
        if not isinstance(module, FusedMoE):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() > 0 and param.shape[0] == module.num_local_experts:
                found.append((int(module.layer_id), name, param))
    return found


def export_routed_weights(model: Any, socket_path: str, moe_ep_rank: int) -> RoutedManifest:
    """Move the model's routed-expert parameters into the shared file beside ``socket_path``.

    ``moe_ep_rank``: the daemon's EP rank, whose first slot is ``moe_ep_rank`` times the local
    slots (the first dimension of every routed tensor).

    Each parameter's bytes are copied into its place in the file and the parameter's ``data``
    becomes that place (the copy, then ``param.data = view``), before anything reads
    ``routed_experts_weights_of_layer`` (sglang computes it lazily from ``param.data``).
    """
    import torch

    params = routed_parameters(model)
    if not params:
        raise SharedWeightsError(
            "the loaded model has no FusedMoE parameters to share; the model-backed daemon "
            "serves MoE models only"
        )
    offsets: list[int] = []
    size = 0
    for _layer, _name, param in params:
        offsets.append(size)
        size += _aligned(param.numel() * param.element_size())
    manifest = manifest_path(socket_path)
    data_path = manifest.with_name(Path(socket_path).stem + DATA_SUFFIX)
    temp_data = data_path.with_name(f"{data_path.name}.tmp{os.getpid()}")
    with open(temp_data, "wb") as handle:
        handle.truncate(size)
    os.chmod(temp_data, 0o600)
    flat = torch.from_file(str(temp_data), shared=True, size=size, dtype=torch.uint8)
    base = flat.data_ptr()
    placed: dict[int, str] = {}
    for (_layer, name, param), offset in zip(params, offsets, strict=True):
        nbytes = param.numel() * param.element_size()
        view = flat[offset : offset + nbytes].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        placed[offset] = name
    os.replace(temp_data, data_path)
    layers: dict[int, tuple[RoutedTensor, ...]] = {}
    for layer, tensors in routed_mapping(model).items():
        described = []
        for tensor in tensors:
            offset = tensor.data_ptr() - base
            nbytes = tensor.numel() * tensor.element_size()
            if offset not in placed or offset + nbytes > size or not tensor.is_contiguous():
                raise SharedWeightsError(
                    f"layer {layer}'s routed-expert tensor of shape {tuple(tensor.shape)} is not "
                    "in the shared file: the model handed sglang's updater a tensor that is not "
                    "one of its FusedMoE parameters"
                )
            described.append(
                RoutedTensor(placed[offset], _dtype_name(tensor.dtype), tuple(tensor.shape), offset)
            )
        layers[int(layer)] = tuple(described)
    slot_counts = {tensor.shape[0] for tensors in layers.values() for tensor in tensors}
    if len(slot_counts) != 1:
        raise SharedWeightsError(
            f"the routed-expert tensors disagree on their slots: {slot_counts}"
        )
    num_local_slots = slot_counts.pop()
    result = RoutedManifest(
        data_path.name, size, os.getpid(), moe_ep_rank * num_local_slots, num_local_slots, layers
    )
    _write_manifest(manifest, result)
    logger.info(
        "shared %d routed-expert parameters of %d layers (%d bytes) in %s",
        len(params),
        len(layers),
        size,
        data_path,
    )
    return result


def _aligned(size: int) -> int:
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise SharedWeightsError(f"routed-expert dtype {name} is not one of {DTYPE_NAMES}")
    return name


def _write_manifest(path: Path, manifest: RoutedManifest) -> None:
    document = {
        "format_version": FORMAT_VERSION,
        "pid": manifest.pid,
        "data_file": manifest.data_file,
        "size": manifest.size,
        "first_slot": manifest.first_slot,
        "num_local_slots": manifest.num_local_slots,
        "layers": {
            str(layer): [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset}
                for t in tensors
            ]
            for layer, tensors in sorted(manifest.layers.items())
        },
    }
    temp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    temp.write_text(json.dumps(document, sort_keys=True))
    os.chmod(temp, 0o600)
    os.replace(temp, path)


# --- an engine's (or a test's) side --------------------------------------------------------------


def read_manifest(socket_path: str | os.PathLike[str]) -> RoutedManifest:
    """The manifest of the daemon serving ``socket_path``, checked field by field."""
    path = manifest_path(socket_path)
    data = _read_own_file(path, MAX_MANIFEST_BYTES)
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise SharedWeightsError(f"{path} is not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format_version") != FORMAT_VERSION:
        raise SharedWeightsError(
            f"{path} is not a version {FORMAT_VERSION} routed-weights manifest; restart the "
            "model-backed daemon with this toolkit"
        )
    data_file = document.get("data_file")
    if not isinstance(data_file, str) or "/" in data_file or not data_file.endswith(DATA_SUFFIX):
        raise SharedWeightsError(f"{path}: data_file {data_file!r} is not a file beside it")
    size, pid, first_slot, num_slots = (
        _count(path, document, key) for key in ("size", "pid", "first_slot", "num_local_slots")
    )
    layers_doc = document.get("layers")
    if not isinstance(layers_doc, dict) or not layers_doc:
        raise SharedWeightsError(f"{path}: no layers")
    layers: dict[int, tuple[RoutedTensor, ...]] = {}
    for key, tensors in layers_doc.items():
        if not key.isdigit() or not isinstance(tensors, list) or not tensors:
            raise SharedWeightsError(f"{path}: layer {key!r} is not a layer id with tensors")
        layers[int(key)] = tuple(_checked_tensor(path, entry, size, num_slots) for entry in tensors)
    return RoutedManifest(data_file, size, pid, first_slot, num_slots, layers)


def _count(path: Path, document: dict[str, Any], key: str) -> int:
    value = document.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SharedWeightsError(f"{path}: {key} is {value!r}, not a count")
    return value


def _checked_tensor(path: Path, entry: Any, size: int, num_slots: int) -> RoutedTensor:
    if not isinstance(entry, dict):
        raise SharedWeightsError(f"{path}: a tensor entry is not an object: {entry!r}")
    name, dtype, shape = (entry.get(k) for k in ("name", "dtype", "shape"))
    if not isinstance(name, str) or not name.isidentifier() or dtype not in DTYPE_NAMES:
        raise SharedWeightsError(f"{path}: tensor name {name!r} or dtype {dtype!r} is not valid")
    offset = _count(path, entry, "offset")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or shape[0] != num_slots
        or offset % ALIGNMENT
    ):
        raise SharedWeightsError(f"{path}: tensor {name} has shape {shape!r}, offset {offset}")
    if offset + _nbytes(shape, str(dtype)) > size:
        raise SharedWeightsError(f"{path}: tensor {name} ends past the data file's {size} bytes")
    return RoutedTensor(name, str(dtype), tuple(shape), offset)


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    import torch

    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _read_own_file(path: Path, limit: int) -> bytes:
    """A regular file (no link) of this user, others unable to write it, at most ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SharedWeightsError(
            f"{path} does not exist: no model-backed daemon exported its routed weights there "
            "(start one with python -m sglang_integration.testing.daemons)"
        ) from None
    except OSError as exc:
        raise SharedWeightsError(f"{path} cannot be opened ({exc}); is it a link?") from None
    with os.fdopen(fd, "rb") as handle:
        _check_owned(path, os.fstat(handle.fileno()))
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise SharedWeightsError(f"{path} is larger than {limit} bytes")
    return data


def _check_owned(path: Path, status: os.stat_result) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise SharedWeightsError(f"{path} is not a regular file")
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise SharedWeightsError(
            f"{path} belongs to uid {status.st_uid} or others may write it "
            f"(mode {stat.S_IMODE(status.st_mode):o}); refusing to map it"
        )


class RoutedWeights:
    """A daemon's routed-expert tensors, mapped read-write from its shared file."""

    def __init__(self, socket_path: str | os.PathLike[str]) -> None:
        import torch

        self.manifest = read_manifest(socket_path)
        data_path = manifest_path(socket_path).with_name(self.manifest.data_file)
        try:
            status = os.stat(data_path, follow_symlinks=False)
        except FileNotFoundError:
            raise SharedWeightsError(f"{data_path} does not exist") from None
        _check_owned(data_path, status)
        if status.st_size != self.manifest.size:
            raise SharedWeightsError(
                f"{data_path} holds {status.st_size} bytes, its manifest says "
                f"{self.manifest.size}; the daemon is rewriting it, map it again"
            )
        flat = torch.from_file(
            str(data_path), shared=True, size=self.manifest.size, dtype=torch.uint8
        )
        self._flat = flat
        self.names: dict[int, list[str]] = {}
        self.routed_experts_weights_of_layer: dict[int, list[Any]] = {}
        for layer, tensors in sorted(self.manifest.layers.items()):
            views = []
            for tensor in tensors:
                end = tensor.offset + _nbytes(tensor.shape, tensor.dtype)
                dtype = getattr(torch, tensor.dtype)
                views.append(flat[tensor.offset : end].view(dtype).view(tensor.shape))
            self.routed_experts_weights_of_layer[layer] = views
            self.names[layer] = [tensor.name for tensor in tensors]

    @property
    def first_slot(self) -> int:
        return self.manifest.first_slot

    @property
    def num_local_slots(self) -> int:
        return self.manifest.num_local_slots


def attach_routed_weights(socket_path: str | os.PathLike[str]) -> RoutedWeights:
    """Map the routed-expert tensors of the daemon serving ``socket_path`` (read-write)."""
    return RoutedWeights(socket_path)


class RoutedModel:
    """The part of a model sglang's EPLB code reads (``routed_experts_weights_of_layer``), over
    a daemon's mapped routed weights: what an engine rank's model is after the IPC loader mapped
    the daemon's tensors (``shared_experts.SharedExpertsModel`` cites where EPLB reads it)."""

    def __init__(self, weights: RoutedWeights) -> None:
        self.weights = weights

    @property
    def routed_experts_weights_of_layer(self) -> dict[int, list[Any]]:
        return self.weights.routed_experts_weights_of_layer
