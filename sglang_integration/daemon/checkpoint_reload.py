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

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from layout_ledger.core.reloads import ReloadFailed, ReloadReport
from layout_ledger.wire.healing import Healing
from sglang_integration.content.model_slots import ModelSlots, routed_mapping
from sglang_integration.daemon.checkpoint_reads import (
    INDEX_FILE,
    ChildReader,
    ReadFailed,
    ReadSession,
    tensors_of,
)
from sglang_integration.settings import DEFAULT_HEAL_TIMEOUT
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

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


def expert_prefixes(layer: int, experts: Sequence[int]) -> list[str]:
    """The name prefixes of ``experts``' tensors of ``layer`` (weights and scales)."""
    return [f"model.layers.{layer}.mlp.experts.{expert}." for expert in experts]


def reload_failure(exc: ReadFailed) -> ReloadFailed:
    """A failed checkpoint read in the daemon's words, naming the file and the cause."""
    if exc.path is None:
        return ReloadFailed(f"the checkpoint could not be read ({exc.cause})")
    if Path(exc.path).name == INDEX_FILE:
        return ReloadFailed(
            f"the checkpoint's index {exc.path} cannot be read ({exc.cause}); a daemon reloads "
            f"only from a local checkpoint with {INDEX_FILE}"
        )
    return ReloadFailed(
        f"the checkpoint file {exc.path} cannot be read ({exc.cause}); restore the checkpoint "
        f"the daemon loaded"
    )


class CheckpointReloader:
    """Rewrites local slots of a loaded model from its checkpoint (a ``SlotReloader``)."""

    def __init__(
        self,
        model: Any,
        model_config: Any,
        checkpoint: str | Path,
        slots: ModelSlots,
        timeout: float = DEFAULT_HEAL_TIMEOUT,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.checkpoint = Path(checkpoint)
        self.slots = slots
        self.reader = ChildReader(timeout)  # each read in a child, within ``timeout`` seconds
        self.max_layer_bytes = 0  # the most tensor bytes held at once (one layer's)

    def __call__(
        self, physical_to_logical_map: Sequence[Sequence[int]], slots: Mapping[int, Sequence[int]]
    ) -> ReloadReport:
        from sglang_integration.daemon.placement import install_daemon_metadata

        started = time.perf_counter()
        try:
            session = self.reader.session(str(self.checkpoint))
        except ReadFailed as exc:
            raise reload_failure(exc) from None
        try:
            read = session.index_bytes
            install_daemon_metadata(
                self.model_config, [list(row) for row in physical_to_logical_map]
            )
            layers = tuple(sorted(slots))
            for layer in layers:
                experts = sorted(
                    {int(physical_to_logical_map[layer][slot]) for slot in slots[layer]}
                )
                read += self._reload_layer(session, layer, experts)
        finally:
            session.close()
        _synchronize()
        fingerprints = self.slots.fingerprints(list(layers))
        return ReloadReport(
            layers=layers,
            slots=sum(len(slots[layer]) for layer in layers),
            bytes_read=read,
            seconds=time.perf_counter() - started,
            fingerprints=fingerprints,
        )

    def _reload_layer(self, session: ReadSession, layer: int, experts: Sequence[int]) -> int:
        """Read ``experts``' tensors of ``layer`` in the child and load them; the bytes read."""
        try:
            entries, mapped, layer_bytes, _ = session.read_layer(expert_prefixes(layer, experts))
        except ReadFailed as exc:
            raise reload_failure(exc) from None
        try:
            if not entries:
                raise ReloadFailed(
                    f"the checkpoint's index names no tensor of layer {layer}'s experts "
                    f"{list(experts)}; is it the checkpoint this daemon loaded?"
                )
            self.max_layer_bytes = max(self.max_layer_bytes, layer_bytes)
            tensors = tensors_of(entries, mapped)
            try:
                self.model.load_weights(iter(tensors))
            except Exception as exc:
                raise ReloadFailed(
                    f"sglang's loader refused layer {layer}'s experts ({type(exc).__name__}: "
                    f"{str(exc)[:200]})"
                ) from None
            finally:
                del tensors
        finally:
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a view still held: the GC closes it
                    mapped.close()
        return layer_bytes

    def cancel(self) -> None:
        """Stop every read now and refuse new ones (the daemon is stopping)."""
        self.reader.cancel()


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
    timeout: float = DEFAULT_HEAL_TIMEOUT,
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
    reloader = CheckpointReloader(model, model_config, checkpoint, slots, timeout)
    problem = raw_reload_problem(reloader, physical_to_logical_map)
    if problem is not None:
        logger.warning("no heal or reload from the checkpoint: %s", problem)
        return Healing.unavailable_because(problem, mode)
    logger.info("heal %s: a dirty daemon reloads its dirty layers from %s", mode, checkpoint)
    return Healing(mode, reloader)
