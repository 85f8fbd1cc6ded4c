"""Reloading a loaded daemon's local slots from its checkpoint, in place: heals and reloads.

``CheckpointReloader`` rewrites the routed experts of given local slots, placed by a given
``physical_to_logical_map``, with sglang's own loader: ``install_daemon_metadata`` sets the map
the loader places by (every replica listed), then ``model.load_weights`` runs over an iterator of
only those experts' tensors, one layer at a time, read by name through the checkpoint's
safetensors index (never the whole checkpoint); ``FusedMoE.weight_loader`` copies each into
``param.data[slot]`` (``UPSTREAM_LINES``), the same storage every engine maps. sglang's own
``update_weights_from_disk`` cannot serve here: it refuses while the weight cache is on, reads the
whole checkpoint and runs post-load processing, which on some backends reallocates storage.

A raw reload is right only where post-load processing leaves experts as loaded (BF16 with triton
or DeepGEMM, FP8 blocks without UE8M0 scales). ``raw_reload_problem`` decides it once at load,
on the loaded model itself: it clones one layer's local slots, reloads them, compares the bytes
and puts the clone back. Where they differ (UE8M0 requantised weights, per-tensor FP8,
flashinfer trtllm layouts, aiter), heal and reload are off, with the reason logged and in
``status``. Restore at start (``restore.py``) loads into a chosen map at load time; this is the
same mechanism on a loaded daemon.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from layout_ledger.core.reloads import ReloadFailed, ReloadReport
from layout_ledger.wire.healing import Healing
from sglang_integration.content.model_slots import ModelSlots, routed_mapping
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# The index is read from a directory this daemon does not own: bounded before it is parsed
# (DeepSeek-V3's is about 9 MB).
MAX_INDEX_BYTES = 64 * 1024 * 1024

_LAYER_FILE = "srt/layers/moe/fused_moe_triton/layer.py"
_DEEPSEEK_LOADER = "srt/models/deepseek_common/deepseek_weight_loader.py"
UPSTREAM_LINES = (
    UpstreamLine(
        _LAYER_FILE,
        879,
        "expert_data.copy_(loaded_weight)",
        "a loaded expert is copied in place into its slot's existing storage",
    ),
    UpstreamLine(
        _LAYER_FILE,
        1388,
        "expert_data = param.data[expert_id]",
        "the slot is a view of the parameter every engine maps",
    ),
    UpstreamLine(
        _DEEPSEEK_LOADER,
        550,
        "self.post_load_weights(is_nextn=is_nextn, weight_names=weight_names)",
        "DeepSeek's post-load step sees only the names loaded: no kv_b_proj, nothing redone",
    ),
)


class CheckpointIndex:
    """The checkpoint's safetensors index: which file holds each tensor (read once per use, so
    a missing or changed file shows)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / INDEX_FILE
        try:
            with path.open("rb") as handle:
                raw = handle.read(MAX_INDEX_BYTES + 1)
        except OSError as exc:
            raise ReloadFailed(
                f"the checkpoint's index {path} cannot be read ({exc.strerror or exc}); a daemon "
                f"reloads only from a local checkpoint with {INDEX_FILE}"
            ) from None
        if len(raw) > MAX_INDEX_BYTES:
            raise ReloadFailed(f"{path} is larger than {MAX_INDEX_BYTES} bytes; not an index")
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ReloadFailed(f"{path} is not a safetensors index (no weight_map)") from None
        if not isinstance(weight_map, dict):
            raise ReloadFailed(f"{path}: weight_map is not an object")
        self.index_bytes = len(raw)
        self.weight_map: dict[str, str] = weight_map

    def expert_tensors(self, layer: int, experts: Sequence[int]) -> dict[str, list[str]]:
        """File -> the names of ``experts``' tensors of ``layer`` it holds (weights, scales)."""
        prefixes = tuple(f"model.layers.{layer}.mlp.experts.{expert}." for expert in experts)
        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            if not name.startswith(prefixes):
                continue
            if not isinstance(file, str) or "/" in file or file.startswith("."):
                raise ReloadFailed(
                    f"the index names an unsafe file for tensor {name[:128]!r}; refusing it"
                )
            by_file.setdefault(file, []).append(name)
        return by_file


def read_layer_tensors(
    directory: Path, by_file: Mapping[str, Sequence[str]]
) -> tuple[list[tuple[str, Any]], int]:
    """The named tensors (one layer's) and the bytes of tensor data read."""
    from safetensors import safe_open

    tensors: list[tuple[str, Any]] = []
    read = 0
    for file, names in sorted(by_file.items()):
        path = directory / file
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in sorted(names):
                    tensor = handle.get_tensor(name)
                    read += tensor.numel() * tensor.element_size()
                    tensors.append((name, tensor))
        except Exception as exc:
            raise ReloadFailed(
                f"the checkpoint file {path} cannot be read ({type(exc).__name__}: "
                f"{str(exc)[:200]}); restore the checkpoint the daemon loaded"
            ) from None
    return tensors, read


class CheckpointReloader:
    """Rewrites local slots of a loaded model from its checkpoint (a ``SlotReloader``)."""

    def __init__(
        self, model: Any, model_config: Any, checkpoint: str | Path, slots: ModelSlots
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.checkpoint = Path(checkpoint)
        self.slots = slots
        self.max_layer_bytes = 0  # the most tensor bytes held at once (one layer's)

    def __call__(
        self, physical_to_logical_map: Sequence[Sequence[int]], slots: Mapping[int, Sequence[int]]
    ) -> ReloadReport:
        from sglang_integration.daemon.placement import install_daemon_metadata

        started = time.perf_counter()
        index = CheckpointIndex(self.checkpoint)
        read = index.index_bytes
        install_daemon_metadata(self.model_config, [list(row) for row in physical_to_logical_map])
        layers = tuple(sorted(slots))
        for layer in layers:
            experts = sorted({int(physical_to_logical_map[layer][slot]) for slot in slots[layer]})
            by_file = index.expert_tensors(layer, experts)
            if not by_file:
                raise ReloadFailed(
                    f"the checkpoint's index names no tensor of layer {layer}'s experts "
                    f"{experts}; is it the checkpoint this daemon loaded?"
                )
            tensors, layer_bytes = read_layer_tensors(self.checkpoint, by_file)
            self.max_layer_bytes = max(self.max_layer_bytes, layer_bytes)
            read += layer_bytes
            try:
                self.model.load_weights(iter(tensors))
            except Exception as exc:
                raise ReloadFailed(
                    f"sglang's loader refused layer {layer}'s experts ({type(exc).__name__}: "
                    f"{str(exc)[:200]})"
                ) from None
            del tensors
        _synchronize()
        fingerprints = self.slots.fingerprints(list(layers))
        return ReloadReport(
            layers=layers,
            slots=sum(len(slots[layer]) for layer in layers),
            bytes_read=read,
            seconds=time.perf_counter() - started,
            fingerprints=fingerprints,
        )


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def raw_reload_problem(
    reloader: CheckpointReloader, physical_to_logical_map: Sequence[Sequence[int]]
) -> str | None:
    """Whether a raw reload leaves the experts as the load left them: one layer's local slots
    cloned, reloaded, compared byte for byte, and put back. None: it does; else why not."""
    import torch

    routed = routed_mapping(reloader.model)
    if not routed:
        return "the model has no routed-expert tensors"
    layer = min(routed)
    first, count = reloader.slots.first_slot, reloader.slots.num_slots
    saved = [tensor.detach().clone() for tensor in routed[layer]]
    try:
        reloader(physical_to_logical_map, {layer: list(range(first, first + count))})
        for index, (now, before) in enumerate(zip(routed[layer], saved, strict=True)):
            if not torch.equal(_bytes_of(now), _bytes_of(before)):
                return (
                    f"sglang's post-load processing changes the experts on this backend (layer "
                    f"{layer}'s tensor {index} differs after a raw reload from the checkpoint); "
                    f"heal and reload are off, a dirty daemon must be restarted"
                )
    except ReloadFailed as exc:
        return str(exc)
    finally:
        for tensor, before in zip(routed[layer], saved, strict=True):
            tensor.data.copy_(before)
        from sglang_integration.daemon.placement import install_daemon_metadata

        install_daemon_metadata(reloader.model_config, [list(r) for r in physical_to_logical_map])
    return None


def _bytes_of(tensor: Any) -> Any:
    import torch

    return tensor.detach().contiguous().view(torch.uint8)


def daemon_healing(
    model: Any,
    model_config: Any,
    model_path: str,
    slots: ModelSlots | None,
    physical_to_logical_map: Sequence[Sequence[int]],
    *,
    mode: str,
) -> Healing:
    """What a loaded daemon can do from its checkpoint, decided once at load: a reloader, or
    the reason it has none (logged)."""
    reason = None
    checkpoint = Path(model_path)
    if slots is None:
        reason = (
            "it records no slot fingerprints (--expert-layout-content-check off, or no "
            "routed-expert tensors), so it could not verify reloaded slots"
        )
    elif model_config is None:
        reason = "the daemon's model config was not kept at load"
    elif not (checkpoint / INDEX_FILE).is_file():
        reason = f"its checkpoint {model_path!r} is not a local directory with {INDEX_FILE}"
    if reason is not None or slots is None:
        logger.warning("no heal or reload from the checkpoint: %s", reason)
        return Healing.unavailable_because(reason or "no slots", mode)
    reloader = CheckpointReloader(model, model_config, checkpoint, slots)
    problem = raw_reload_problem(reloader, physical_to_logical_map)
    if problem is not None:
        logger.warning("no heal or reload from the checkpoint: %s", problem)
        return Healing.unavailable_because(problem, mode)
    logger.info("heal %s: a dirty daemon reloads its dirty layers from %s", mode, checkpoint)
    return Healing(mode, reloader)
