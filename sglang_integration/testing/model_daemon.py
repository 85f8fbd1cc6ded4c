"""One model-backed weight cache daemon: sglang's own daemon with a real model, on a CPU.

``run_model_daemon(spec, rank)`` is one EP rank's process (``daemons`` starts one per rank).
It publishes real ``ServerArgs`` for the checkpoint (``--device cpu``, ``tp_size = ep_size``,
``--enable-eplb`` unless ``record`` is off, the redundant experts, an optional
``--init-expert-location``), installs the GPU stand-ins (``gpu_stand_ins``, and nothing else
differs from a GPU daemon) and, with the plugin, the daemon hooks, then runs sglang's own entry
point ``run_weight_cache_daemon``: ``WeightCacheDaemon.__init__``, ``load`` (``_init_distributed``
with the ranks' gloo groups, ``_initialize_eplb_expert_location_metadata``, the model class built
from ``config.json`` and the checkpoint loaded by sglang's ``DefaultModelLoader``), the readiness
barrier of the daemon group and the serve loop. The plugin's hooks run where sglang calls them.

Files in the run directory ``RUN`` (sglang's socket and ready templates and the ledger template
point there; the stand-in names GPU ``R`` ``rank{R}``): ``rank{R}.sock``, ``rank{R}.ready``,
``rank{R}.sqlite`` (the ledger), ``rank{R}.routed`` and ``rank{R}.routed.json`` (the shared
routed-expert weights, ``routed_weights``), ``rank{R}.log``.

The daemon flags (``add_daemon_flags``) are the model-less daemon's (``testing.daemon``):
``--expert-layout-content-check``, ``--keep-versions``, ``--prune-every``,
``--request-timeout``, ``--no-record``, ``--without-plugin``, ``--log-level``, ``--dtype``
(sglang's: the model's dtype, default the checkpoint's), and every other
``--expert-layout-*`` flag of the daemon launcher (``settings``); they reach the daemon as the
launcher hands them to spawned daemons, in the environment. One more is the toolkit's own:
``--post-load-rescale`` installs ``gpu_stand_ins``' optional stand-in 6 (a backend whose
post-load step changes the loaded experts).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_integration import settings
from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

logger = logging.getLogger(__name__)

SOCKET_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"
READY_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"
# Seconds the daemon group's readiness barrier waits for every rank (sglang's
# --weight-cache-timeout): every rank of a group starts at once here.
READY_TIMEOUT = 300

# The dtypes a model-backed daemon (and an engine on it) computes in: sglang's --dtype.
MODEL_DTYPES = ("bfloat16", "float32")

# The model-less daemon's names for three launcher settings (testing.daemon's flags).
_ALIASES: dict[str, settings.Setting[Any]] = {
    "--keep-versions": settings.KEEP_VERSIONS,
    "--prune-every": settings.PRUNE_EVERY,
    "--request-timeout": settings.REQUEST_TIMEOUT,
}
# The ledger lies in the run directory (RUN/rank{R}.sqlite): its template is not a flag here.
_LAUNCHER_FLAGS: tuple[tuple[str, settings.Setting[Any]], ...] = tuple(
    (flag, setting)
    for flag, setting in settings.DAEMON_FLAGS
    if setting is not settings.LEDGER_TEMPLATE
)


def add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every daemon of a group takes (see the module docstring)."""
    group = parser.add_argument_group("daemon flags", "passed to every daemon of the group")
    for flag, setting in (*_LAUNCHER_FLAGS, *_ALIASES.items()):
        settings.add_setting_flag(group, flag, setting)
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--no-record",
        action="store_true",
        help="start the daemons without --enable-eplb: they keep no layout record",
    )
    mode.add_argument(
        "--without-plugin",
        action="store_true",
        help="run sglang's daemon with no expert layout hook (sglang 0.5.23's own behaviour)",
    )
    group.add_argument(
        "--init-expert-location",
        default=None,
        metavar="JSON_OR_FILE",
        help="sglang's --init-expert-location: the initial physical_to_logical_map",
    )
    group.add_argument(
        "--post-load-rescale",
        action="store_true",
        help="testing only: a stand-in for a GPU backend whose post-load processing changes the "
        "loaded routed experts (UE8M0 requantisation, flashinfer trtllm layouts): after sglang's "
        "post-load step, w13 x2 and w2 x1/2 in place",
    )
    group.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default=None,
        help="sglang's --dtype for the model (default: the checkpoint's); float32 loads a BF16 "
        "checkpoint losslessly, for exact comparisons of engines' outputs",
    )
    group.add_argument("--log-level", default="INFO")


def daemon_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment the flags give each daemon (``SettingError`` for a bad value)."""
    env: dict[str, str] = {}
    for flag, setting in (*_LAUNCHER_FLAGS, *_ALIASES.items()):
        raw = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if raw is not None:
            setting.parse(raw, flag)
            env[setting.env] = raw
    return env


@dataclass(frozen=True)
class ModelDaemonSpec:
    """What every daemon of one group needs (picklable: it crosses the forkserver)."""

    run_dir: str
    checkpoint: str
    ep_size: int
    port: int
    num_redundant_experts: int
    record: bool = True
    plugin: bool = True
    init_expert_location: str | None = None
    log_level: str = "INFO"
    post_load_rescale: bool = False  # gpu_stand_ins' stand-in 6
    dtype: str | None = None  # sglang's --dtype (None: the checkpoint's)
    env: tuple[tuple[str, str], ...] = field(default=())

    def path(self, rank: int, suffix: str) -> str:
        from sglang_integration.testing.gpu_stand_ins import device_name

        return str(Path(self.run_dir) / f"{device_name(rank)}{suffix}")

    def environment(self) -> dict[str, str]:
        """sglang's socket and ready templates and the ledger template in the run directory,
        then the daemon flags' settings."""
        run = Path(self.run_dir)
        return {
            **QUIET_SGLANG_ENV,
            SOCKET_TEMPLATE_ENV: str(run / "{device_uuid}.sock"),
            READY_TEMPLATE_ENV: str(run / "{device_uuid}.ready"),
            settings.LEDGER_TEMPLATE.env: str(run / "{device_uuid}.sqlite"),
            **dict(self.env),
        }

    def server_args(self) -> Any:
        from sglang.srt.server_args import ServerArgs

        extra: dict[str, Any] = {}
        if self.record:
            extra = {
                "enable_eplb": True,
                "ep_num_redundant_experts": self.num_redundant_experts,
            }
            if self.init_expert_location is not None:
                extra["init_expert_location"] = self.init_expert_location
        return ServerArgs(
            model_path=self.checkpoint,
            device="cpu",
            tp_size=self.ep_size,
            ep_size=self.ep_size,
            skip_tokenizer_init=True,
            dtype=self.dtype or "auto",
            weight_cache_timeout=READY_TIMEOUT,
            **extra,
        )


def run_model_daemon(spec: ModelDaemonSpec, rank: int, log_path: str | None = None) -> None:
    """Process target: rank ``rank``'s daemon, until SIGTERM (sglang's handler ends serve)."""
    from sglang_integration.testing.cpu_engine import release_forkserver
    from sglang_integration.testing.daemon_control import redirect_output

    if log_path is not None:
        redirect_output(log_path)
    os.environ.update(spec.environment())
    logging.basicConfig(
        level=spec.log_level.upper(),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
        force=True,
    )
    release_forkserver()  # die with the process that started the group (cpu_engine's note)
    logger.info(
        "model-backed daemon rank %d of %d starting (plugin %s)",
        rank,
        spec.ep_size,
        "on" if spec.plugin else "off",
    )
    from sglang.srt.weight_cache import daemon as daemon_module
    from sglang.srt.weight_cache.protocol import cleanup_stale_daemon_files

    from sglang_integration.testing import gpu_stand_ins

    gpu_stand_ins.install(daemon_module)
    if spec.post_load_rescale:
        gpu_stand_ins.rescale_after_post_load()
    if spec.plugin:
        from sglang_integration.daemon.hooks import install_daemon_hooks

        install_daemon_hooks()
    cleanup_stale_daemon_files(gpu_stand_ins.device_name(rank))  # as sglang's launcher does
    daemon_module.run_weight_cache_daemon(
        spec.server_args(),
        gpu_id=rank,
        tp_rank=rank,
        pp_rank=0,
        dist_init_method=f"tcp://127.0.0.1:{spec.port}",
    )


def flags_of(argv: Sequence[str]) -> argparse.Namespace:
    """Parse daemon flags alone (a test's or the demo's list, as the command takes them)."""
    parser = argparse.ArgumentParser(prog="daemon flags", add_help=False)
    add_daemon_flags(parser)
    return parser.parse_args(list(argv))
