"""sglang's real model in an engine rank on a CPU: loaded the way ``ModelRunner.load_model`` does.

``load_engine_model`` is the body of ``ModelRunner.load_model`` for a CPU engine rank: sglang's
own ``build_load_config`` and ``maybe_enable_ipc_weight_cache`` from the published server args,
then ``get_model_loader(...).load_model(...)``:

- with the weight cache off (a reference engine, ``--from-disk``), sglang's
  ``DefaultModelLoader``: every weight from the checkpoint, the routed experts placed by
  ``FusedMoE``'s loader into the slots of the global ``ExpertLocationMetadata`` the engine's
  startup installed (sglang's initial layout, or ``--init-expert-location``);
- in client mode, sglang's ``IpcModelLoader``, the plugin's hooks around it: it checks the quant
  method, sends ``fetch_state`` to its daemon (the plugin adds the ``expert_layout`` field and
  raises on ``layout_refused``; a config mismatch raises), falls back to the disk when no daemon
  socket exists, and maps what the daemon serves with ``_load_zero_copy_mode``, then starts its
  daemon-liveness watchdog. That mapping of CUDA IPC handles is the one step that needs a GPU:
  ``gpu_stand_ins`` stand-in 9 replaces it with ``load_from_daemon_files``, which builds the model
  on the CPU, loads every weight but the routed experts from the checkpoint with sglang's
  ``DefaultModelLoader`` (the same bytes a daemon loads), and makes each routed-expert
  parameter's ``data`` the daemon's own tensor, mapped from the daemon's shared file
  (``routed_weights``). A move by any engine on that daemon, a heal or a reload by the daemon,
  lands in the bytes this model computes with.

sglang's torch.compile'd helpers (``TopK``'s grouped top-k, rope) run eagerly (``run_eagerly``):
each engine rank is a fresh process, inductor compiles them again in each (1.5 to 18 s on this
CPU), and eager is what they compile from.
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
_LOAD_UTILS = "srt/model_executor/model_runner_components/load_model_utils.py"
# What of sglang's loading the engine's load calls (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(_LOAD_UTILS, 200, "def build_load_config(", "ModelRunner.load_model's config"),
    UpstreamLine(
        _LOAD_UTILS, 244, "def maybe_enable_ipc_weight_cache(", "client mode: the IPC loader"
    ),
    UpstreamLine(_LOADER_FILE, 285, "def _initialize_model(", "the model class, built"),
    UpstreamLine(
        _LOADER_FILE,
        759,
        "def _get_all_weights(",
        "the checkpoint's weights, which stand-in 9 filters for an engine on a daemon",
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
    """The loaded model and the daemon's routed weights it maps (None: weights from disk)."""

    model: Any
    mapped: Any  # routed_weights.RoutedWeights


def load_engine_model(server_args: Any, model_config: Any) -> EngineModel:
    """``ModelRunner.load_model``'s loading, for this rank (module docstring)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        build_load_config,
        maybe_enable_ipc_weight_cache,
    )
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import get_model, get_parallel

    load_config = build_load_config(
        server_args=server_args,
        tp_rank=get_parallel().tp_rank,
        remote_instance_weight_transporter_engine=None,
        remote_instance_weight_transporter_session_id="",
        draft_model_idx=None,
        weight_cache_mode=get_model().weight_cache_mode,
        weight_cache_socket=get_model().weight_cache_socket,
    )
    maybe_enable_ipc_weight_cache(load_config=load_config)
    loader = get_model_loader(load_config=load_config, model_config=model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu", 0))
    return EngineModel(model, getattr(loader, "daemon_routed_weights", None))


def load_from_daemon_files(
    ipc_loader: Any, model_config: Any, device_config: Any, entries: Any, quant_config: Any
) -> Any:
    """Stand-in 9, ``IpcModelLoader._load_zero_copy_mode`` on a CPU (module docstring): the model
    built and filled from the checkpoint but for its routed experts, which are the daemon's
    tensors of its shared file beside ``ipc_loader.socket_path``. The daemon's ``fetch_state``
    served no entries (stand-in 5); any would be a daemon this toolkit did not start."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from sglang_integration.testing.routed_weights import attach_routed_weights

    if entries:
        raise SharedWeightsError(
            f"the daemon at {ipc_loader.socket_path} served {len(entries)} CUDA IPC entries; "
            "on a CPU only a model-backed daemon of this toolkit (python -m "
            "sglang_integration.testing.daemons) can serve an engine"
        )
    mapped = attach_routed_weights(ipc_loader.socket_path)
    disk = DefaultModelLoader(LoadConfig(tp_rank=ipc_loader.load_config.tp_rank))
    device = torch.device("cpu")
    with set_default_torch_dtype(model_config.dtype):
        with device:
            model = _initialize_model(model_config, disk.load_config, quant_config)
        weights: Iterator[tuple[str, Any]] = (
            (name, tensor)
            for name, tensor in disk._get_all_weights(model_config, model)
            if not is_routed_expert_weight(name)
        )
        DefaultModelLoader.load_weights_and_postprocess(model, weights, device)
    map_routed_parameters(model, mapped)
    ipc_loader.daemon_routed_weights = mapped
    return model


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

    def __init__(self, model: Any, moe_ep_rank: int) -> None:
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
        self.first_slot = moe_ep_rank * self.num_local_slots
