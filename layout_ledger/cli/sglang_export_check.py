"""``layout-ledger export --check``: load the exported file through sglang's own code path.

The one module of ``layout_ledger`` that imports sglang (and through it torch), only inside
``check_export``, and ``export`` imports it only for ``--check``. It runs what an engine started
with ``--init-expert-location FILE`` runs (real ``ServerArgs`` on ``device="cpu"``), and passes
when the metadata's map equals the ledger's and the model has the ledger's layers and experts.

sglang 0.5.23 function it calls: ``compute_initial_expert_location_metadata``
(sglang/srt/eplb/expert_location.py:766).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_ledger.cli.held_maps import check_ep_size
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map

DISABLED_MODEL_ARCHS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
# sglang 0.5.23's model registry logs an import error, with a traceback, for each optional
# architecture it cannot load on an install without its CUDA dependencies; these are the ones
# that do so (measured on this project's CPU machine). The check sets it unless already set.
QUIET_ARCHS = "falcon_mamba,inkling,mamba,midashenglm"


@dataclass(frozen=True)
class ExportCheck(JsonShaped):
    model_path: str
    ep_size: int
    equal: bool
    detail: str


def _first_difference(expected: Map, actual: list[list[int]]) -> str:
    if len(actual) != len(expected):
        return f"sglang's map has {len(actual)} layers, the ledger's {len(expected)}"
    for layer, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if len(want) != len(got):
            return f"layer {layer}: sglang's map has {len(got)} slots, the ledger's {len(want)}"
        for slot, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                return f"layer {layer} slot {slot}: sglang's map holds {b}, the ledger's {a}"
    return ""


def _metadata_map(
    export_path: Path, model_path: Path, geometry: Geometry, ep_size: int
) -> tuple[Any, list[list[int]] | None]:
    os.environ.setdefault(DISABLED_MODEL_ARCHS_ENV, QUIET_ARCHS)
    from sglang.srt.configs.model_config import ModelConfig  # type: ignore[import-untyped]
    from sglang.srt.eplb.expert_location import (  # type: ignore[import-untyped]
        ModelConfigForExpertLocation,
        compute_initial_expert_location_metadata,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish  # type: ignore[import-untyped]
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-untyped]

    args = ServerArgs(
        model_path=str(model_path),
        device="cpu",
        tp_size=ep_size,
        ep_size=ep_size,
        ep_num_redundant_experts=geometry.num_physical_slots - geometry.num_logical_experts,
        init_expert_location=str(export_path),
        skip_tokenizer_init=True,
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    model_config = ModelConfig.from_server_args(args)
    expected = ModelConfigForExpertLocation.from_model_config(model_config)
    if expected is None:
        return None, None
    if (expected.num_layers, expected.num_logical_experts) != (
        geometry.num_layers,
        geometry.num_logical_experts,
    ):
        return expected, None
    metadata = compute_initial_expert_location_metadata(model_config, moe_ep_rank=0)
    if metadata is None:
        return expected, None
    rows: Any = metadata.physical_to_logical_map_cpu.tolist()
    return expected, [[int(v) for v in row] for row in rows]


def check_inputs(model_path: str | Path, geometry: Geometry, ep_size: int) -> None:
    """What the check needs besides the file: a model directory with a ``config.json``, and an
    EP size that divides the slots (``export --check`` asks this before writing anything)."""
    if not (Path(model_path) / "config.json").is_file():
        raise LedgerError(
            f"--model-path {model_path} has no config.json; pass the model's directory, the one "
            f"that holds its config.json"
        )
    check_ep_size(ep_size, geometry)


def check_export(
    export_path: str | Path,
    model_path: str | Path,
    expected: Map,
    geometry: Geometry,
    *,
    ep_size: int = 1,
    shown_as: str | Path | None = None,
) -> ExportCheck:
    """Load ``export_path`` as ``--init-expert-location`` for ``model_path``; compare the maps.
    Messages name the file ``shown_as`` (default: ``export_path``), for a temporary file that
    becomes the output only when the check passes."""
    export_path, model_path = Path(export_path), Path(model_path)
    check_inputs(model_path, geometry, ep_size)
    # sglang prints to stdout here and there, and warns about every GPU-only feature a CPU
    # lacks: keep stdout for the command's own output and stderr for real problems.
    sglang_logger = logging.getLogger("sglang")
    level = sglang_logger.level
    sglang_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, actual = _metadata_map(export_path, model_path, geometry, ep_size)
    except Exception as exc:  # sglang's own failure, whatever its type, is the check's answer
        raise LedgerError(
            f"sglang could not load {shown_as or export_path} as --init-expert-location for "
            f"{model_path}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        sglang_logger.setLevel(level)
    if model is None:
        detail = f"sglang builds no expert-location metadata for {model_path} (no routed experts)"
        return ExportCheck(str(model_path), ep_size, False, detail)
    if actual is None:
        detail = (
            f"the model has {model.num_layers} MoE layers x {model.num_logical_experts} logical "
            f"experts but the ledger's maps have {geometry.num_layers} layers x "
            f"{geometry.num_logical_experts} logical experts"
        )
        return ExportCheck(str(model_path), ep_size, False, detail)
    difference = _first_difference(expected, actual)
    if difference:
        return ExportCheck(str(model_path), ep_size, False, difference)
    return ExportCheck(
        str(model_path),
        ep_size,
        True,
        f"sglang's metadata map equals the ledger's ({len(actual)} layers x "
        f"{len(actual[0])} physical slots)",
    )
