"""Metadata from a daemon's map equals metadata from ``--init-expert-location`` with that map.

Real ``ServerArgs``, ``publish`` and ``ModelConfig`` on the CPU, from tiny ``config.json`` files
written here (no weights): a Qwen3-MoE and a DeepSeek-V3. For every (moe a2a backend, expert
dispatch) pair sglang accepts here, and EP ranks 0 and 1, one fresh process per model compares
every field of ``ExpertLocationMetadata`` tensor by tensor (dtype, shape, device, values):

- ``expert_metadata.metadata_from_map`` vs sglang's ``compute_initial_expert_location_metadata``
  with ``--init-expert-location`` naming a JSON file of the map;
- the engine's initial metadata after ``expert_metadata.adopt_map`` (in place) vs the same.

The same processes check the shape rule and the ``--enable-eplb`` rule. Fresh processes keep
sglang's environment changes (``import sglang``, ``publish``) out of the test runner (they fork
from the forkserver of tests/test_engine_startup_hook.py, which has imported sglang once).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import sglang_context

from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

NUM_LAYERS = 3
NUM_LOGICAL = 8
NUM_REDUNDANT = 2
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT
COMBOS = [("none", "dynamic"), ("deepep", "dynamic"), ("deepep", "static")]
RANKS = (0, 1)


def moved_map(num_layers: int, num_slots: int, num_logical: int, seed: int = 3) -> list[list[int]]:
    """A map like a rebalance leaves: every expert somewhere, hot ones replicated, shuffled."""
    rnd = random.Random(seed)
    rows = []
    for _ in range(num_layers):
        row = list(range(num_logical)) + rnd.sample(range(num_logical), num_slots - num_logical)
        rnd.shuffle(row)
        rows.append(row)
    return rows


def write_tiny_deepseek_v3_config(directory: Path, num_layers: int, num_experts: int) -> Path:
    """A DeepSeek-V3 ``config.json`` (no weights), one dense layer first as in the real model."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- in the fresh process -------------------------------------------------------------------


def _publish(model_dir: str, rank: int, **overrides: Any) -> Any:
    """Publish real ServerArgs for EP rank ``rank`` of a TP2/EP2 engine; return ModelConfig."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    fields: dict[str, Any] = {
        "model_path": model_dir,
        "device": "cpu",
        "tp_size": 2,
        "ep_size": 2,
        "enable_eplb": True,
        "ep_num_redundant_experts": NUM_REDUNDANT,
        "skip_tokenizer_init": True,
        **overrides,
    }
    args = ServerArgs(**fields)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    return ModelConfig.from_server_args(args)


def _differences(name: str, ours: Any, reference: Any) -> list[str]:
    """Every field of the two ExpertLocationMetadata that differs, tensor by tensor."""
    import torch

    problems = []
    for field in dataclasses.fields(reference):
        a, b = getattr(ours, field.name), getattr(reference, field.name)
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                problems.append(f"{name}.{field.name}: {type(a).__name__} vs tensor")
            elif (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
                problems.append(
                    f"{name}.{field.name}: {a.dtype}/{tuple(a.shape)}/{a.device} vs "
                    f"{b.dtype}/{tuple(b.shape)}/{b.device}"
                )
            elif not torch.equal(a, b):
                problems.append(f"{name}.{field.name}: values differ")
        elif a != b:
            problems.append(f"{name}.{field.name}: {a!r} vs {b!r}")
    return problems


def _expect_error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # the test asserts the type name and the text
        return f"{type(exc).__name__}: {exc}"
    return None


def _report_for_model(model_dir: str, map_file: str, results: Any) -> None:
    import os

    os.environ.update(QUIET_SGLANG_ENV)
    from sglang.srt.eplb.expert_location import compute_initial_expert_location_metadata

    from sglang_integration.engine.metadata import adopt_map, map_of, metadata_from_map

    moved = json.loads(Path(map_file).read_text())["physical_to_logical_map"]
    report: dict[str, Any] = {"cases": []}
    for a2a, dispatch in COMBOS:
        for rank in RANKS:
            flags = {"moe_a2a_backend": a2a, "ep_dispatch_algorithm": dispatch}
            model_config = _publish(model_dir, rank, **flags)
            from_map = metadata_from_map(model_config, moved, rank)
            engine = compute_initial_expert_location_metadata(model_config, moe_ep_rank=rank)
            initial = map_of(engine)
            changed = adopt_map(model_config, moved, rank, engine)
            _publish(model_dir, rank, init_expert_location=map_file, **flags)
            reference = compute_initial_expert_location_metadata(model_config, moe_ep_rank=rank)
            report["cases"].append(
                {
                    "a2a": a2a,
                    "dispatch": dispatch,
                    "rank": rank,
                    "changed": changed,
                    "initial": initial,
                    "reference_map": map_of(reference),
                    "rank_dispatch": (
                        None
                        if reference.logical_to_rank_dispatch_physical_map is None
                        else reference.logical_to_rank_dispatch_physical_map.tolist()
                    ),
                    "all_physical": reference.logical_to_all_physical_map.tolist(),
                    "problems": _differences("from_map", from_map, reference)
                    + _differences("adopted", engine, reference),
                }
            )

    # Equal to the initial layout: kept as is, the very same object, unchanged.
    model_config = _publish(model_dir, 0, moe_a2a_backend="none", ep_dispatch_algorithm="dynamic")
    engine = compute_initial_expert_location_metadata(model_config, moe_ep_rank=0)
    before = engine.physical_to_logical_map.clone()
    report["kept_changed"] = adopt_map(model_config, map_of(engine), 0, engine)
    report["kept_equal"] = bool((engine.physical_to_logical_map == before).all())

    # Shape: a daemon with 4 redundant experts (12 slots), and one with a layer too few.
    wider = [row + row[:2] for row in moved]
    report["shape_wider"] = _expect_error(lambda: adopt_map(model_config, wider, 0, engine))
    report["shape_fewer_layers"] = _expect_error(
        lambda: adopt_map(model_config, moved[:-1], 0, engine)
    )

    # Neither --enable-eplb nor --init-expert-location: no dispatch through the metadata.
    plain = _publish(model_dir, 0, enable_eplb=False)
    plain_engine = compute_initial_expert_location_metadata(plain, moe_ep_rank=0)
    report["no_eplb_moved"] = _expect_error(lambda: adopt_map(plain, moved, 0, plain_engine))
    report["no_eplb_initial"] = _expect_error(
        lambda: adopt_map(plain, map_of(plain_engine), 0, plain_engine)
    )
    results.put(report)


def _run_report(tmp_path: Path, model_dir: Path) -> dict[str, Any]:
    map_file = tmp_path / "daemon_map.json"
    map_file.write_text(
        json.dumps({"physical_to_logical_map": moved_map(NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL)})
    )
    context = sglang_context()
    results = context.Queue()
    process = context.Process(
        target=_report_for_model, args=(str(model_dir), str(map_file), results)
    )
    process.start()
    try:
        report = results.get(timeout=150)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    return report


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp_path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_moe":
        model_dir = write_tiny_moe_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
    else:
        model_dir = write_tiny_deepseek_v3_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
    return _run_report(tmp_path, model_dir)


@pytest.mark.timeout(200)
def test_metadata_from_the_daemon_map_equals_init_expert_location_field_by_field(
    report: dict[str, Any],
) -> None:
    cases = report["cases"]
    assert [(c["a2a"], c["dispatch"], c["rank"]) for c in cases] == [
        (a2a, dispatch, rank) for a2a, dispatch in COMBOS for rank in RANKS
    ]
    moved = moved_map(NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL)
    for case in cases:
        assert case["problems"] == [], case
        assert case["reference_map"] == moved
        assert case["changed"] is True
        assert case["initial"] != moved


@pytest.mark.timeout(200)
def test_the_comparison_covers_rank_dependent_fields(report: dict[str, Any]) -> None:
    """Static dispatch builds a per-rank table, and an a2a backend a per-rank nearest replica:
    equal fields there mean the EP rank reached init_by_mapping."""
    by_key = {(c["a2a"], c["dispatch"], c["rank"]): c for c in report["cases"]}
    assert by_key[("deepep", "static", 0)]["rank_dispatch"] is not None
    assert (
        by_key[("deepep", "static", 0)]["rank_dispatch"]
        != by_key[("deepep", "static", 1)]["rank_dispatch"]
    )
    assert by_key[("none", "dynamic", 0)]["rank_dispatch"] is None
    assert (
        by_key[("deepep", "dynamic", 0)]["all_physical"]
        != by_key[("deepep", "dynamic", 1)]["all_physical"]
    )


@pytest.mark.timeout(200)
def test_a_map_equal_to_the_initial_layout_keeps_the_metadata_as_is(
    report: dict[str, Any],
) -> None:
    assert report["kept_changed"] is False
    assert report["kept_equal"] is True


@pytest.mark.timeout(200)
def test_a_map_of_another_shape_names_both_redundant_expert_counts(
    report: dict[str, Any],
) -> None:
    assert report["shape_wider"] == (
        "LayoutShapeMismatch: the weight cache daemon's expert map has 3 layers x 12 physical "
        "slots, but this engine's layout is 3 layers x 10 slots (8 logical experts). The daemon "
        "runs with --ep-num-redundant-experts 4 and the engine with "
        "--ep-num-redundant-experts 2: start both with the same value (and the same model)."
    )
    assert report["shape_fewer_layers"].startswith(
        "LayoutShapeMismatch: the weight cache daemon's expert map has 2 layers x 10 physical "
        "slots, but this engine's layout is 3 layers x 10 slots"
    )


@pytest.mark.timeout(200)
def test_a_moved_map_without_enable_eplb_fails_saying_the_engine_would_route_initial_slots(
    report: dict[str, Any],
) -> None:
    assert report["no_eplb_moved"] is not None
    assert report["no_eplb_moved"].startswith("LayoutNotFollowed: ")
    assert "without --enable-eplb or --init-expert-location" in report["no_eplb_moved"]
    assert "as if every expert were in its initial slot" in report["no_eplb_moved"]
    # The initial layout itself needs no dispatch through the metadata.
    assert report["no_eplb_initial"] is None
