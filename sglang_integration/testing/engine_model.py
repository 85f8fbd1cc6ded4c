"""sglang's real model in an engine rank on a CPU: its weights from disk or from its daemon.

An engine rank that computes tokens (``cpu_engine`` with ``EngineSpec.checkpoint``, the
``generate`` command) builds the model class the checkpoint's ``config.json`` names with
sglang's own ``_initialize_model`` (under the model's dtype, on the CPU) and fills it with
sglang's own ``DefaultModelLoader`` from the checkpoint, as a daemon does. What differs is where
the routed experts come from:

- **from disk** (``daemon_socket`` None: the weight cache off, a reference engine): every
  weight from the checkpoint, the experts placed by sglang's ``FusedMoE`` loader into the slots
  of the global ``ExpertLocationMetadata`` the engine's startup installed (sglang's initial
  layout, or ``--init-expert-location``);
- **from the daemon** (weights from the daemons): every weight but the routed experts from the
  checkpoint (the loader's iterator without ``model.layers.L.mlp.experts.E.*``), then each
  routed-expert parameter's ``data`` becomes the daemon's own tensor, mapped from the daemon's
  shared file (``routed_weights``): what CUDA IPC maps on a GPU. A move by any engine on that
  daemon, a heal or a reload by the daemon, lands in the bytes this model computes with.

On a GPU the IPC loader maps every parameter from the daemon; here the non-expert parameters
are the engine's own copies from the same checkpoint (the same bytes: both load them with
sglang's loader). sglang's torch.compile'd helpers (``TopK``'s grouped top-k, rope) run eagerly
(``run_eagerly``): each engine rank is a fresh process, inductor compiles them again in each
(1.5 to 18 s on this CPU), and eager is what they compile from.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sglang_integration.testing.model_errors import SharedWeightsError
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_LOADER_FILE = "srt/model_loader/loader.py"
# What of sglang's loader the engine's build calls (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(_LOADER_FILE, 285, "def _initialize_model(", "the model class, built"),
    UpstreamLine(
        _LOADER_FILE,
        759,
        "def _get_all_weights(",
        "the checkpoint's weights, which the build filters for an engine on a daemon",
    ),
    UpstreamLine(
        _LOADER_FILE,
        1028,
        "def load_weights_and_postprocess(model, weights, target_device):",
        "model.load_weights, then each quant method's post-load step",
    ),
)

# The checkpoint names of routed-expert weights (Qwen3-MoE's and DeepSeek-V3's): these come
# from the daemon; shared experts (``mlp.shared_experts``) and gates do not.
ROUTED_EXPERT_NAME = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")


def is_routed_expert_weight(name: str) -> bool:
    return ROUTED_EXPERT_NAME.match(name) is not None


def run_eagerly() -> None:
    """sglang's torch.compile'd helpers run as plain torch in this process (module docstring)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


@dataclass
class EngineModel:
    """The built model and where its routed experts live (``mapped``: the daemon's file)."""

    model: Any
    mapped: Any  # routed_weights.RoutedWeights, or None for weights from disk

    @property
    def from_daemon(self) -> bool:
        return self.mapped is not None


def build_engine_model(model_config: Any, daemon_socket: str | None) -> EngineModel:
    """Build and fill the model (module docstring); ``daemon_socket`` None: from disk."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from sglang_integration.testing.routed_weights import attach_routed_weights

    mapped = None if daemon_socket is None else attach_routed_weights(daemon_socket)
    load_config = LoadConfig()
    loader = DefaultModelLoader(load_config)
    quant_config = _get_quantization_config(model_config, load_config)
    device = torch.device("cpu")
    with set_default_torch_dtype(model_config.dtype):
        with device:
            model = _initialize_model(model_config, load_config, quant_config)
        weights: Iterator[tuple[str, Any]] = loader._get_all_weights(model_config, model)
        if mapped is not None:
            weights = ((name, w) for name, w in weights if not is_routed_expert_weight(name))
        DefaultModelLoader.load_weights_and_postprocess(model, weights, device)
    if mapped is not None:
        map_routed_parameters(model, mapped)
    return EngineModel(model.eval(), mapped)


def map_routed_parameters(model: Any, mapped: Any) -> int:
    """Each routed-expert parameter's ``data`` becomes the daemon's tensor of the same layer and
    name (shape and dtype checked); then every tensor of the model's
    ``routed_experts_weights_of_layer`` must be one of them. Returns the parameters mapped."""
    from sglang_integration.content.model_slots import routed_mapping
    from sglang_integration.testing.routed_weights import routed_parameters

    views: dict[tuple[int, str], Any] = {}
    for layer, names in mapped.names.items():
        for name, tensor in zip(names, mapped.routed_experts_weights_of_layer[layer], strict=True):
            views[(layer, name)] = tensor
    count = 0
    for layer, name, param in routed_parameters(model):
        view = views.get((layer, name))
        if view is None:
            raise SharedWeightsError(
                f"the daemon shares no {name} of layer {layer}: it loaded another model or "
                "another quantization than this engine"
            )
        if view.dtype != param.dtype or tuple(view.shape) != tuple(param.shape):
            raise SharedWeightsError(
                f"the daemon's {name} of layer {layer} is {tuple(view.shape)} {_dtype(view)}, "
                f"this engine's is {tuple(param.shape)} {_dtype(param)}: start the engine with "
                f"the daemons' dtype (--dtype {_dtype(view)}) and geometry"
            )
        param.data = view
        count += 1
    shared = {tensor.data_ptr() for tensor in views.values()}
    for layer, tensors in routed_mapping(model).items():
        for tensor in tensors:
            if tensor.data_ptr() not in shared:
                raise SharedWeightsError(
                    f"layer {layer}'s routed-expert tensor of shape {tuple(tensor.shape)} is "
                    "not the daemon's: the model read its experts before they were mapped"
                )
    logger.info("mapped %d routed-expert parameters onto the daemon's tensors", count)
    return count


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class OwnRoutedWeights:
    """A model's own routed-expert tensors (weights from disk), in the shape a daemon's mapped
    ``RoutedWeights`` has, for the checkpoint judge (``checkpoint_experts.ModelExperts``)."""

    def __init__(self, model: Any, first_slot: int) -> None:
        from sglang_integration.content.model_slots import routed_mapping
        from sglang_integration.testing.routed_weights import routed_parameters

        by_pointer = {param.data_ptr(): name for _layer, name, param in routed_parameters(model)}
        self.routed_experts_weights_of_layer = {
            layer: list(tensors) for layer, tensors in routed_mapping(model).items()
        }
        self.names = {
            layer: [by_pointer[tensor.data_ptr()] for tensor in tensors]
            for layer, tensors in self.routed_experts_weights_of_layer.items()
        }
        slots = {t.shape[0] for ts in self.routed_experts_weights_of_layer.values() for t in ts}
        if len(slots) != 1:
            raise SharedWeightsError(f"the routed-expert tensors disagree on their slots: {slots}")
        self.num_local_slots = slots.pop()
        self.first_slot = first_slot
