"""What a model-backed daemon runs on a CPU in place of what needs a GPU: one stand-in each.

A model-backed daemon (``model_daemon``) is sglang's own ``WeightCacheDaemon`` building the real
model class and loading a real checkpoint through sglang's own loader. Five steps on that path
need a GPU; each is replaced here, in this process only, and nothing else is (``UPSTREAM_LINES``
names the line each stands in for):

1. **The platform.** Without a GPU, sglang resolves its base ``SRTPlatform``, whose device
   methods (``get_device``, ``set_device``, ...) raise ``NotImplementedError``; sglang's own CPU
   platform (``CpuSRTPlatform``, what ``SGLANG_USE_CPU_ENGINE=1`` selects) takes its place in
   every module that bound the resolved object at import (``use_cpu_platform``), naming GPU
   ``R``'s device UUID ``rank{R}`` (a GPU's UUID names its daemon's socket and ledger), so
   sglang's own ``get_socket_path`` gives ``RUN/rank{R}.sock`` from the socket template.
   ``SGLANG_USE_CPU_ENGINE`` itself is not set: it switches sglang's layers to CPU kernels of
   ``sgl_kernel`` (not installed here) and CPU weight layouts, which a GPU daemon does not use.
2. **No pynccl or custom all-reduce.** ``GroupCoordinator`` builds a ``PyNcclCommunicator`` for
   every group of more than one rank, which raises "Expected a cuda device"; the groups are made
   with pynccl, custom all-reduce, mscclpp and symmetric-memory all-reduce off
   (``groups_without_pynccl``), so collectives run on gloo, as the daemon's CPU groups do.
3. **Rope in torch.** The rotary embedding imports vllm's kernel unless sglang's module-level
   ``_is_cpu`` is true; it is set (``rope_in_torch``): rope then runs in torch in the engines'
   forward passes (the daemons compute no token).
4. **The daemon's device check.** ``WeightCacheDaemon.load`` refuses a platform that is not
   CUDA-alike (its first statement: CUDA IPC export needs one). The daemon module's platform
   (only that module's) is stand-in 1's, answering "CUDA-alike" (``daemon_platform``).
5. **The CUDA IPC export.** ``_export_state`` exports every tensor as a CUDA IPC handle; instead
   the routed-expert parameters are moved into a shared-memory file every engine maps
   (``routed_weights``), and the daemon states no transport entries (``export_to_shared_memory``).

One more, off unless asked for (``--post-load-rescale``), stands in for a GPU-only backend rather
than for a missing GPU:

6. **A post-load step that changes the loaded experts.** On some backends sglang's post-load
   processing (``DefaultModelLoader.postprocess_weights``, which runs each quant method's
   ``process_weights_after_loading`` at the end of the load) rewrites the routed experts: UE8M0
   requantisation on DeepGEMM, flashinfer trtllm's layouts. None of them runs on a CPU; in their
   place ``rescale_after_post_load`` wraps that step so that, after it, every routed-expert
   tensor is rescaled in place (``POST_LOAD_FACTORS``: ``w13`` times 2, ``w2`` times 1/2, every
   expert alike, exact in BF16 and for FP8 block scales; FP8 weights themselves are left). The
   checkpoint's bytes are then no longer what a slot holds, as on those backends, so a raw
   reload from the checkpoint would not give back what the load left.

An engine rank that holds the model and computes tokens (``engine_model``, ``greedy``) runs
sglang's own forward pass: the model's ``forward``, ``TopK``'s torch path, the standard
dispatcher, the torch-native MoE runner and ``TorchNativeAttnBackend`` over sglang's KV pools.
It needs stand-ins 1-3 and two more, each for a branch sglang takes only without a GPU:

7. **Experts on other ranks, in the torch-native MoE runner.** With EP, sglang's standard
   dispatcher marks the top-k entries whose expert lies on another rank with id ``-1``
   (``_map_topk_ids_to_local_experts``), which the GPU runners (triton, deep_gemm) drop. On a
   CPU without AMX, ``UnquantizedFusedMoEMethod.forward_cpu`` calls
   ``fused_moe_native.moe_forward_native``, which indexes with ``-1`` ("index -1 is out of
   bounds"; clamping alone is not enough: its ``scatter_`` then undercounts a token whose two
   entries became the same id). ``moe_without_other_ranks`` gives those entries weight 0 and
   id 0 and calls sglang's own ``fused_moe_native.fused_moe_forward_native``: each rank then
   adds exactly its own experts' share, as a GPU runner does, and the TP all-reduce sums them.
8. **DeepSeek-V3's attention on the torch-native backend** (DeepSeek-V3 only). sglang
   registers no ``torch_native`` handler in ``deepseek_common/attention_backend_handler.py``,
   so it falls back to the triton handler, which picks MHA for a prefill; the torch-native
   backend then reads K and V of the MHA shape from the latent (MLA) cache and fails.
   ``mla_on_torch_native`` registers a ``torch_native`` handler that takes sglang's MLA path
   (``_dispatch_mla_subtype``), which the torch-native backend serves, for every batch.

9. **The engine's zero-copy mapping.** In client mode sglang's ``IpcModelLoader`` runs as it
   is (its quant check, ``fetch_state`` with the plugin's hooks, its config check, its disk
   fallback when no daemon socket exists, its daemon watchdog) up to
   ``_load_zero_copy_mode``, which maps the CUDA IPC handles the daemon served. The daemon here
   serves none (stand-in 5); in its place ``engine_model.load_from_daemon_files`` builds the
   model on the CPU, loads every weight but the routed experts from the checkpoint with
   sglang's loader, and maps the routed-expert parameters onto the daemon's shared file
   (``zero_copy_from_daemon_files``).

``install(daemon_module)`` installs the first five in this process, ``install_in_engine()``
stand-ins 1-3, 7, 8 and 9. Everything else of the daemon
(``__init__``, ``_init_distributed``'s process groups,
``_initialize_eplb_expert_location_metadata``, the rest of ``load`` with the model build and the
loader, ``_await_cluster_ready_to_serve``, ``serve``, ``_handle_connection``) is sglang's own,
with the plugin's hooks at their real call sites.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from sglang_integration.testing.model_errors import StandInError
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_DAEMON_FILE = "srt/weight_cache/daemon.py"
_LOADER_FILE = "srt/model_loader/loader.py"
UPSTREAM_LINES: tuple[UpstreamLine, ...] = (
    UpstreamLine(
        "srt/platforms/__init__.py",
        186,
        "return SRTPlatform()",
        "1: without a GPU sglang resolves its base platform, whose device methods raise",
    ),
    UpstreamLine(
        "srt/distributed/parallel_state.py",
        463,
        "if use_pynccl and self.world_size > 1:",
        "2: a group of several ranks builds pynccl, which needs a CUDA device",
    ),
    UpstreamLine(
        "srt/distributed/parallel_state.py",
        2160,
        "def init_model_parallel_group(",
        "2: the group maker whose pynccl and all-reduce options the stand-in turns off",
    ),
    UpstreamLine(
        "srt/layers/rotary_embedding/base.py",
        138,
        "from vllm._custom_ops import rotary_embedding",
        "3: the rope kernel import that sglang's _is_cpu skips",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        181,
        "device_uuid = current_platform.get_device_uuid(gpu_id)",
        "1: the socket is named by the device UUID",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        257,
        "if not current_platform.is_cuda_alike():",
        "4: load's first statement refuses a platform that is not CUDA-alike",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        396,
        "self._export_state()",
        "5: load exports every tensor as a CUDA IPC handle",
    ),
    UpstreamLine(
        _DAEMON_FILE,
        455,
        "self.transport_backend = choose_daemon_transport_backend(state_tensors)",
        "5: what the export leaves for fetch_state: a transport and its entries",
    ),
    UpstreamLine(
        _LOADER_FILE,
        1030,
        "DefaultModelLoader.postprocess_weights(model, target_device)",
        "6: the load ends with the post-load step, called through the class",
    ),
    UpstreamLine(
        _LOADER_FILE,
        1079,
        "def postprocess_weights(model, target_device):",
        "6: the post-load step the stand-in wraps (each quant method's "
        "process_weights_after_loading)",
    ),
)


_MOE_NATIVE_FILE = "srt/layers/moe/fused_moe_native.py"
_DEEPSEEK_HANDLER_FILE = "srt/models/deepseek_common/attention_backend_handler.py"
FORWARD_UPSTREAM_LINES = (
    UpstreamLine(
        "srt/layers/moe/token_dispatcher/standard.py",
        99,
        "topk_ids < 0,",
        "7: the dispatcher keeps -1 for the top-k entries whose expert is on another rank",
    ),
    UpstreamLine(
        "srt/layers/quantization/unquant.py",
        1383,
        "from sglang.srt.layers.moe.fused_moe_native import moe_forward_native",
        "7: the CPU path without AMX calls the module's moe_forward_native (looked up per call)",
    ),
    UpstreamLine(
        _MOE_NATIVE_FILE,
        77,
        "cnts.scatter_(1, topk_ids.to(torch.int64), 1)",
        "7: the line that fails on -1",
    ),
    UpstreamLine(
        _MOE_NATIVE_FILE,
        21,
        "def fused_moe_forward_native(",
        "7: the torch-native runner the stand-in calls with the -1 entries weighed 0",
    ),
    UpstreamLine(
        _DEEPSEEK_HANDLER_FILE,
        55,
        'return cls._handlers.get(backend_name, cls._handlers.get("triton"))',
        "8: a backend without a handler falls back to triton's",
    ),
    UpstreamLine(
        _DEEPSEEK_HANDLER_FILE,
        251,
        "return AttnForwardMethod.MHA",
        "8: triton's handler takes MHA for a prefill, which the torch-native backend cannot "
        "serve from the latent cache",
    ),
    UpstreamLine(
        _DEEPSEEK_HANDLER_FILE,
        58,
        "def _dispatch_mla_subtype(attn, forward_batch):",
        "8: sglang's MLA choice, the handler the stand-in registers",
    ),
)
_IPC_LOADER_FILE = "srt/weight_cache/ipc_loader.py"
ENGINE_LOAD_UPSTREAM_LINES = (
    UpstreamLine(
        _IPC_LOADER_FILE,
        152,
        "model = self._load_zero_copy_mode(",
        "9: the IPC loader maps what fetch_state served",
    ),
    UpstreamLine(
        _IPC_LOADER_FILE,
        306,
        "def _load_zero_copy_mode(",
        "9: the CUDA IPC mapping the stand-in replaces",
    ),
)
UPSTREAM_LINES = UPSTREAM_LINES + FORWARD_UPSTREAM_LINES + ENGINE_LOAD_UPSTREAM_LINES


# Stand-in 6: the factor of each routed-expert tensor, by the prefix of its FusedMoE parameter
# name (``w13_weight``, ``w13_weight_scale_inv``, ...). Powers of two: exact, and undone exactly.
POST_LOAD_FACTORS = {"w13_": 2.0, "w2_": 0.5}


def device_name(gpu_id: int) -> str:
    """The stand-in device UUID of GPU ``gpu_id``: ``rank{gpu_id}``."""
    return f"rank{gpu_id}"


def use_cpu_platform() -> Any:
    """Stand-in 1: sglang's ``CpuSRTPlatform`` as the platform, wherever the resolved one is
    bound (``platforms._current_platform`` and each loaded module's ``current_platform``), with
    one change: GPU ``R``'s device UUID is ``rank{R}``, where sglang's CPU platform answers the
    machine's architecture for every device (two daemons on one host would share a socket)."""
    from sglang.srt import platforms
    from sglang.srt.platforms.cpu import CpuSRTPlatform

    class CpuDevicesPlatform(CpuSRTPlatform):  # type: ignore[misc]
        """sglang's CPU platform, one device name per rank."""

        def get_device_uuid(self, device_id: int = 0) -> str:
            return device_name(device_id)

    resolved = platforms._current_platform
    cpu = CpuDevicesPlatform()
    platforms._current_platform = cpu
    if resolved is not None:
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get("current_platform") is resolved:
                namespace["current_platform"] = cpu
    return cpu


def groups_without_pynccl() -> None:
    """Stand-in 2: sglang's group maker with pynccl and the device all-reduces off."""
    from sglang.srt.distributed import parallel_state

    original = parallel_state.init_model_parallel_group
    if getattr(original, "_without_pynccl", False):
        return

    @functools.wraps(original)
    def make_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(
            use_pynccl=False,
            use_custom_allreduce=False,
            use_mscclpp=False,
            use_torch_symm_mem_allreduce=False,
        )
        return original(*args, **kwargs)

    make_group._without_pynccl = True  # type: ignore[attr-defined]
    parallel_state.init_model_parallel_group = make_group


def rope_in_torch() -> None:
    """Stand-in 3: sglang's rotary embedding takes its torch path (no vllm kernel import)."""
    from sglang.srt.layers.rotary_embedding import base

    if not hasattr(base, "_is_cpu"):
        raise StandInError(
            "sglang's rotary_embedding.base has no _is_cpu any more; recheck gpu_stand_ins"
        )
    base._is_cpu = True


def daemon_platform(daemon_module: Any, cpu: Any) -> None:
    """Stand-in 4: the daemon module's platform passes ``load``'s CUDA check; every other call
    is stand-in 1's CPU platform's (so ``__init__`` names the socket ``rank{R}``)."""
    cpu_class = type(cpu)

    class DaemonCpuPlatform(cpu_class):  # type: ignore[misc,valid-type]
        """Stand-in 1's platform, CUDA-alike to the daemon's load check only."""

        def is_cuda_alike(self) -> bool:
            return True

    daemon_module.current_platform = DaemonCpuPlatform()


def install(daemon_module: Any) -> None:
    """Install the five stand-ins in this process (before the daemon is built)."""
    cpu = use_cpu_platform()
    groups_without_pynccl()
    rope_in_torch()
    daemon_platform(daemon_module, cpu)
    daemon_module.WeightCacheDaemon._export_state = export_to_shared_memory


def export_to_shared_memory(daemon: Any) -> None:
    """Stand-in 5, ``WeightCacheDaemon._export_state`` in this process: instead of exporting CUDA
    IPC handles, move the routed-expert parameters into the shared file beside the daemon's
    socket (``routed_weights.export_routed_weights``) and state no entries, with the transport
    sglang chooses for none, so ``fetch_state`` answers as sglang's daemon does, without tensors.
    """
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.weight_cache.transport import choose_daemon_transport_backend

    from sglang_integration.testing.routed_weights import export_routed_weights

    export_routed_weights(daemon.model, daemon.socket_path, int(get_parallel().moe_ep_rank))
    daemon.state_entries = {}
    daemon.transport_backend = choose_daemon_transport_backend({})


def post_load_factor(name: str, tensor: Any) -> float:
    """Stand-in 6's factor for the routed-expert tensor ``name`` (a FusedMoE parameter name);
    1.0 for one it leaves (FP8 weights: their block scales carry the change)."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        return 1.0
    for prefix, factor in POST_LOAD_FACTORS.items():
        if name.startswith(prefix):
            return factor
    return 1.0


def rescale_routed_experts(model: Any) -> int:
    """Stand-in 6's change, in place: every routed-expert parameter of every FusedMoE layer
    times its ``post_load_factor``. Returns how many tensors changed."""
    from sglang_integration.testing.routed_weights import routed_parameters

    changed = 0
    for _layer, name, param in routed_parameters(model):
        factor = post_load_factor(name, param.data)
        if factor != 1.0:
            param.data.mul_(factor)
            changed += 1
    return changed


def rescale_after_post_load() -> None:
    """Stand-in 6: sglang's post-load step, then ``rescale_routed_experts`` (in this process)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    original = DefaultModelLoader.postprocess_weights
    if getattr(original, "_rescales_experts", False):
        return

    @functools.wraps(original)
    def postprocess_then_rescale(model: Any, target_device: Any) -> None:
        original(model, target_device)
        changed = rescale_routed_experts(model)
        logger.info(
            "post-load stand-in: %d routed-expert tensors rescaled (w13 x2, w2 x1/2)", changed
        )

    postprocess_then_rescale._rescales_experts = True  # type: ignore[attr-defined]
    DefaultModelLoader.postprocess_weights = staticmethod(postprocess_then_rescale)


def moe_without_other_ranks() -> None:
    """Stand-in 7: the torch-native MoE runner, entries of experts on other ranks dropped (the
    module docstring). Idempotent."""
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput

    if getattr(fused_moe_native.moe_forward_native, "_drops_other_ranks", False):
        return

    def moe_forward(layer: Any, x: Any, topk_output: Any, moe_runner_config: Any) -> Any:
        if moe_runner_config.apply_router_weight_on_input:
            raise StandInError("the torch-native MoE runner does not weigh the input")
        weights, ids, logits = topk_output
        elsewhere = ids < 0
        local = type(topk_output)(
            weights.masked_fill(elsewhere, 0), ids.masked_fill(elsewhere, 0), logits
        )
        output = StandardDispatchOutput(
            hidden_states=x, hidden_states_scale=None, topk_output=local
        )
        return fused_moe_native.fused_moe_forward_native(layer, output).hidden_states

    moe_forward._drops_other_ranks = True  # type: ignore[attr-defined]
    fused_moe_native.moe_forward_native = moe_forward


def mla_on_torch_native() -> None:
    """Stand-in 8: a ``torch_native`` attention handler for DeepSeek-V3 that takes sglang's MLA
    path for every batch (the module docstring)."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return handlers._dispatch_mla_subtype(attn, forward_batch)

    handlers.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def zero_copy_from_daemon_files() -> None:
    """Stand-in 9: ``IpcModelLoader._load_zero_copy_mode`` maps the daemon's shared routed
    experts, the rest from the checkpoint (``engine_model.load_from_daemon_files``)."""
    from sglang.srt.weight_cache.ipc_loader import IpcModelLoader

    from sglang_integration.testing.engine_model import load_from_daemon_files

    IpcModelLoader._load_zero_copy_mode = load_from_daemon_files


def install_in_engine() -> None:
    """Install stand-ins 1-3, 7, 8 and 9 in this engine rank's process (before the model is
    built)."""
    use_cpu_platform()
    groups_without_pynccl()
    rope_in_torch()
    moe_without_other_ranks()
    mla_on_torch_native()
    zero_copy_from_daemon_files()
