"""Engines answer: greedy tokens through sglang's own forward pass on the daemons' weights.

The proposal's evidence, measured by outputs (docs/model-daemons.md, "Engines that answer"): R,
an engine of 2 EP ranks that loads everything from disk and never rebalances, gives the
reference tokens (8 prompts x 32 new tokens, greedy); an engine is right when its tokens equal
R's. Real processes throughout: model-backed daemons (sglang's own daemon loading a tiny
Qwen3-MoE from a BF16 checkpoint in float32, so tokens compare exactly), engines holding sglang's
model with their routed experts mapped onto the daemons' tensors, sglang's ``ModelRunner.forward``
and its expert distribution recorder feeding EPLB. The demo shows the same on DeepSeek-V3 too.

One daemon group serves the module's tests in order (each leaves it clean; versions are asserted
relative to where a test found them); the plugin-disabled and BF16 tests start their own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo_cases import DemoConfig, Workspace
from demo_cases.answers import equal_prompts, tokens_of
from demo_cases.workspace import query_daemons, started_workspace, wait_for_daemons

pytestmark = pytest.mark.timeout(600)

# Four MoE layers, two per chunk: two versions per rebalance.
CONFIG = DemoConfig(model="qwen3_moe", num_layers=4, layers_per_chunk=2)
CHUNKS = CONFIG.chunks_per_rebalance
PROMPTS = 8
HEAL_AUTO = ("--expert-layout-heal", "auto")
# A standby's idle time before its lease is released, shortened (30 s by default).
STANDBY_ENV = (
    ("SGLANG_EXPERT_LAYOUT_ROLE", "standby"),
    ("SGLANG_EXPERT_LAYOUT_STANDBY_IDLE", "2"),
    ("SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT", "60"),
)


@pytest.fixture(scope="module")
def workspace() -> Iterator[Workspace]:
    with started_workspace(CONFIG) as space:
        yield space


@pytest.fixture(scope="module")
def reference_pass(workspace: Workspace) -> dict[str, Any]:
    """R's pass, logits kept: from disk, sglang's initial layout, never rebalanced (float32)."""
    engine_r = workspace.launch_from_disk("reference", "R")
    try:
        reply: dict[str, Any] = engine_r.generate(keep_logits=True)[0]
    finally:
        engine_r.exit()
    workspace.answers.reference = reply["tokens"]
    return reply


@pytest.fixture(scope="module")
def reference(reference_pass: dict[str, Any]) -> list[list[int]]:
    """R's tokens."""
    tokens: list[list[int]] = reference_pass["tokens"]
    return tokens


@pytest.fixture(scope="module")
def daemons(workspace: Workspace) -> list[Any]:
    """The module's daemon group (heal auto), shared by its tests in order."""
    return workspace.daemons("answers", experts=workspace.experts("answers"), flags=HEAL_AUTO)


def answer(engine: Any) -> tuple[list[list[int]], int | None]:
    """One greedy pass of ``engine``: its tokens (every rank's the same) and the version its
    daemons give the map it routed with."""
    replies = engine.generate()
    return tokens_of(replies), replies[0]["routed_version"]


def versions(daemons: list[Any]) -> list[int]:
    return [reply.layout.version for reply in query_daemons(daemons)]


def launch(workspace: Workspace, daemons: list[Any], name: str, **kwargs: Any) -> Any:
    engine = workspace.launch("answers", name, daemons, workspace.experts("answers"), **kwargs)
    assert not engine.failed, engine.failed[0]["error"]
    return engine


def new_engine_answers(
    workspace: Workspace, daemons: list[Any], name: str
) -> tuple[list[list[int]], int | None, list[list[int]]]:
    """A new engine starts on ``daemons``, answers once and stops: its tokens, the version it
    routed with and its map at start."""
    engine = launch(workspace, daemons, name)
    try:
        tokens, version = answer(engine)
    finally:
        engine.exit()
    wait_for_daemons(daemons, lambda layout: not layout.attached, f"{name} detached")
    return tokens, version, engine.started[0]["map"]


def moved_slots(before: list[list[int]], after: list[list[int]]) -> int:
    return sum(
        a != b
        for row_a, row_b in zip(before, after, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )


@pytest.fixture(scope="module")
def engine_a_ran(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> dict[str, Any]:
    """Engine A on the daemons: a pass before its first rebalance, then 3 rebalances, each
    followed by a pass; then A stops. What it answered and moved."""
    start = versions(daemons)[0]
    engine_a = launch(workspace, daemons, "A")
    passes = [answer(engine_a)]
    maps = [engine_a.started[0]["map"]]
    rebalance_passes: list[int] = []
    try:
        for _ in range(3):
            reports = engine_a.rebalance(1)
            maps.append(reports[0]["map"])
            rebalance_passes.append(reports[0]["rebalance_passes"][-1])
            passes.append(answer(engine_a))
    finally:
        engine_a.exit()
    wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    return {"start": start, "passes": passes, "maps": maps, "forward_passes": rebalance_passes}


def test_engine_a_answers_as_r_before_its_first_rebalance_and_after_each(
    engine_a_ran: dict[str, Any], reference: list[list[int]]
) -> None:
    start = engine_a_ran["start"]
    routed = [
        (equal_prompts(tokens, reference), version) for tokens, version in engine_a_ran["passes"]
    ]
    assert routed == [(PROMPTS, start + k * CHUNKS) for k in range(4)]


def test_each_rebalance_follows_real_routing_and_moves_experts(
    engine_a_ran: dict[str, Any],
) -> None:
    """Each rebalance ran from ``on_forward_pass_end`` of real forward passes (the recorder's
    counts of their top-k choices) and moved at least one expert."""
    maps = engine_a_ran["maps"]
    assert all(moved_slots(maps[k], maps[k + 1]) > 0 for k in range(3))
    assert all(passes >= CHUNKS for passes in engine_a_ran["forward_passes"])


def test_b_started_after_a_stopped_answers_as_a_final_pass_and_as_r(
    workspace: Workspace,
    engine_a_ran: dict[str, Any],
    reference: list[list[int]],
    daemons: list[Any],
) -> None:
    tokens, version, b_map = new_engine_answers(workspace, daemons, "B")
    a_final, a_version = engine_a_ran["passes"][-1]
    assert (version, tokens) == (a_version, a_final)
    assert equal_prompts(tokens, reference) == PROMPTS
    assert b_map == engine_a_ran["maps"][-1]


def test_d_from_disk_with_the_daemons_map_answers_as_r(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> None:
    the_map = query_daemons(daemons)[0].layout.physical_to_logical_map
    assert the_map != CONFIG.initial_map()
    engine_d = workspace.launch_from_disk("answers", "D", init_expert_location=the_map)
    try:
        assert engine_d.started[0]["map"] == the_map
        assert sum(r["matching"] for r in engine_d.started) == CONFIG.all_slots
        tokens, _ = answer(engine_d)
    finally:
        engine_d.exit()
    assert equal_prompts(tokens, reference) == PROMPTS


def test_an_engine_that_stops_leaves_none_of_sglangs_shared_memory_behind(
    workspace: Workspace,
) -> None:
    """sglang's tensor-parallel group puts its broadcaster in shared memory
    (``/dev/shm/sgl_shm_mq_<pid>_*``, made by the group's first rank); a rank that ends unlinks
    it (``engine_forward.release_model_parallel``), rather than leaving it for the resource
    tracker, which warns about it when the engine's parent exits."""
    engine = workspace.launch_from_disk("answers", "E")
    pids = [process.pid for process in engine.processes]
    try:
        made = shared_memory_of(pids)
    finally:
        engine.exit()
    assert made, "sglang's tensor-parallel group made no shared-memory broadcaster"
    assert shared_memory_of(pids) == []


def shared_memory_of(pids: list[int | None]) -> list[str]:
    """sglang's shared-memory broadcasters made by the processes ``pids``."""
    return [
        name
        for name in os.listdir("/dev/shm")
        for pid in pids
        if name.startswith(f"sgl_shm_mq_{pid}_")
    ]


def test_a_warm_standby_answers_as_r_while_a_keeps_rebalancing(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> None:
    """C, a warm standby, answers with the version it leases; A rebalances while C's lease is
    released; C's next pass routes with A's newest version, and answers as R."""
    engine_a = launch(workspace, daemons, "A-beside")
    engine_c = launch(workspace, daemons, "C", env=STANDBY_ENV)
    try:
        first, first_version = answer(engine_c)
        wait_for_daemons(
            daemons, lambda layout: str(engine_c.engine_id) not in layout.leases, "released"
        )
        engine_a.rebalance(1)
        assert versions(daemons) == [first_version + CHUNKS] * 2
        second, second_version = answer(engine_c)
    finally:
        engine_c.exit()
        engine_a.exit()
    assert second_version == first_version + CHUNKS
    assert equal_prompts(first, reference) == PROMPTS
    assert equal_prompts(second, reference) == PROMPTS
    wait_for_daemons(daemons, lambda layout: not layout.attached, "A and C detached")


def test_b_after_a_sigkill_mid_move_and_the_heal_answers_as_r(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> None:
    before = versions(daemons)[0]
    engine_a = launch(workspace, daemons, "A-killed")
    engine_a.stop_in_move(0)
    engine_a.kill()
    layouts = wait_for_daemons(
        daemons, lambda layout: not layout.attached and not layout.dirty, "healed", timeout=120
    )
    assert [layout.version for layout in layouts] == [before] * 2
    tokens, version, _ = new_engine_answers(workspace, daemons, "B-healed")
    assert version == before
    assert equal_prompts(tokens, reference) == PROMPTS


def test_b_after_its_daemons_converged_answers_as_r(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> None:
    """A is SIGKILLed between its ranks' commits: rank 0's daemon one version ahead, rank 1's
    dirty, then healed; B brings rank 1 to the newest version and answers as R."""
    before = versions(daemons)[0]
    engine_a = launch(workspace, daemons, "A-split")
    engine_a.stop_at_commit(0, skip_rank=1)
    engine_a.kill()
    layouts = wait_for_daemons(
        daemons, lambda layout: not layout.attached and not layout.dirty, "healed"
    )
    assert [layout.version for layout in layouts] == [before + 1, before]
    assert layouts[0].digest != layouts[1].digest  # the chunk moved experts on rank 0's daemon
    tokens, version, _ = new_engine_answers(workspace, daemons, "B-converged")
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [(x.version, x.digest) for x in layouts] == [(before + 1, layouts[0].digest)] * 2
    assert version == before + 1
    assert equal_prompts(tokens, reference) == PROMPTS


def run_generate(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``python -m sglang_integration.testing.generate ARGS`` in this process (its forkserver
    is the workspace's): the exit code and what it wrote on stderr."""
    from sglang_integration.testing.generate import main

    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err


def generate_args(workspace: Workspace, *more: str) -> list[str]:
    return [
        "--model", "qwen3_moe", "--checkpoint", str(workspace.checkpoint), "--ep-size", "2",
        "--dir", str(workspace.experts("answers")), *more,
    ]  # fmt: skip


def test_generate_writes_each_pass_with_the_version_and_digest_it_routed_with(
    workspace: Workspace,
    reference: list[list[int]],
    daemons: list[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = query_daemons(daemons)[0].layout
    out = tmp_path / "A.json"
    code, err = run_generate(
        generate_args(workspace, "--dtype", "float32", "--rebalances", "1", "--out", str(out)),
        capsys,
    )
    assert code == 0, err
    document = json.loads(out.read_text())
    after = query_daemons(daemons)[0].layout
    assert [(p["version"], p["digest"]) for p in document["passes"]] == [
        (before.version, before.digest),
        (after.version, after.digest),
    ]
    assert after.version == before.version + CHUNKS
    assert (document["version"], document["digest"]) == (after.version, after.digest)
    assert document["tokens"] == document["passes"][-1]["tokens"]
    assert all(equal_prompts(p["tokens"], reference) == PROMPTS for p in document["passes"])
    assert document["rebalances"][0]["moved_slots"] > 0
    assert "load_skew" in document
    wait_for_daemons(daemons, lambda layout: not layout.attached, "generate's engine detached")


def test_generate_exits_1_with_sglangs_reason_where_the_engine_would_not_start(
    workspace: Workspace, daemons: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sglang as it is (``--plugin off``) on daemons with a record whose experts moved: the
    daemons refuse its ``fetch_state`` and sglang's loader raises (no fallback to disk)."""
    assert query_daemons(daemons)[0].layout.version > 0
    out = tmp_path / "off.json"
    code, err = run_generate(
        generate_args(workspace, "--dtype", "float32", "--plugin", "off", "--out", str(out)),
        capsys,
    )
    assert code == 1
    assert "the engine did not start" in err and "Daemon config mismatch" in err
    assert not out.exists()
    wait_for_daemons(daemons, lambda layout: not layout.attached, "detached")


def test_generate_refuses_a_dtype_other_than_the_daemons_and_a_bad_prompts_file(
    workspace: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.json"
    code, err = run_generate(
        generate_args(workspace, "--dtype", "bfloat16", "--out", str(out)), capsys
    )
    assert code == 2
    assert "hold float32 routed experts, this engine would compute in bfloat16" in err
    assert "pass --dtype float32" in err
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2, 64]]")
    code, err = run_generate(
        generate_args(
            workspace, "--dtype", "float32", "--prompts", str(prompts), "--out", str(out)
        ),
        capsys,
    )
    assert code == 2
    assert "holds token 64, outside the model's vocabulary [0, 64)" in err
    assert not out.exists()


def test_b_after_the_daemons_restart_answers_as_r_on_the_restored_version(
    workspace: Workspace, reference: list[list[int]], daemons: list[Any]
) -> None:
    before = versions(daemons)[0]
    assert before > 0
    for daemon in daemons:
        daemon.stop()
    restarted = workspace.daemons("answers", experts=workspace.experts("answers"), flags=HEAL_AUTO)
    assert [reply.layout.restored_from.version for reply in query_daemons(restarted)] == [
        before
    ] * 2
    tokens, version, _ = new_engine_answers(workspace, restarted, "B-restored")
    assert version == before
    assert equal_prompts(tokens, reference) == PROMPTS


def test_without_the_plugin_b_answers_otherwise_than_r_the_bug(
    workspace: Workspace, reference: list[list[int]]
) -> None:
    """sglang 0.5.23 as it is (its own daemons, engines with no hook): A is right after its own
    rebalances, B started after it routes with the initial layout over moved experts and its
    greedy tokens are not R's."""
    run_dir = workspace.experts("no-plugin")
    daemons = workspace.daemons("no-plugin", record="no-plugin", experts=run_dir)
    engine_a = workspace.launch("no-plugin", "A", daemons, run_dir, plugin=False)
    try:
        engine_a.rebalance(2)
        a_tokens, _ = answer(engine_a)
    finally:
        engine_a.exit()
    engine_b = workspace.launch("no-plugin", "B", daemons, run_dir, plugin=False)
    try:
        assert engine_b.started[0]["map"] == CONFIG.initial_map()
        b_tokens, _ = answer(engine_b)
    finally:
        engine_b.exit()
    assert equal_prompts(a_tokens, reference) == PROMPTS
    assert equal_prompts(b_tokens, reference) < PROMPTS


def first_step_difference(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    """The largest difference of two passes' first-step logits (every engine computes its first
    step from the same prompts; later steps follow each engine's own tokens)."""
    return max(
        abs(x - y)
        for one, other in zip(a, b, strict=True)
        for x, y in zip(one[0], other[0], strict=True)
    )


def test_bf16_engines_agree_with_the_bf16_reference_within_bf16s_own_error(
    workspace: Workspace, reference_pass: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """BF16 is compared with a stated tolerance, never exactly: each rank's partial expert sum
    is rounded to BF16 before the TP all-reduce, and moved experts regroup those sums (a GPU does
    the same), so a rebalanced engine's logits drift from the BF16 reference's. Stated
    tolerance: on the first step (the same prompts for every engine) a BF16 engine before any
    rebalance computes exactly R-in-BF16's logits, and after its rebalances differs from them by
    no more than BF16 itself differs from float32 there (R in BF16 against R in float32). The
    agreement (prompts and tokens equal to R-in-BF16's) and the largest logit differences are
    reported."""
    run_dir = workspace.experts("bf16")
    daemons = workspace.daemons("bf16", experts=run_dir, flags=("--dtype", "bfloat16"))
    passes: dict[str, Any] = {"R-fp32": reference_pass}
    engine_r = workspace.launch_from_disk("bf16", "R-bf16", dtype="bfloat16")
    try:
        passes["R-bf16"] = engine_r.generate(keep_logits=True)[0]
    finally:
        engine_r.exit()
    engine_a = workspace.launch("bf16", "A-bf16", daemons, run_dir, dtype="bfloat16")
    try:
        passes["before"] = engine_a.generate(keep_logits=True)[0]
        engine_a.rebalance(2)
        passes["after"] = engine_a.generate(keep_logits=True)[0]
    finally:
        engine_a.exit()
    reference = passes["R-bf16"]
    bf16_error = first_step_difference(reference["logits"], passes["R-fp32"]["logits"])
    before = first_step_difference(passes["before"]["logits"], reference["logits"])
    after = first_step_difference(passes["after"]["logits"], reference["logits"])
    agreement = {
        key: (
            equal_prompts(passes[key]["tokens"], reference["tokens"]),
            sum(
                mine == theirs
                for row, ref in zip(passes[key]["tokens"], reference["tokens"], strict=True)
                for mine, theirs in zip(row, ref, strict=True)
            ),
        )
        for key in ("before", "after")
    }
    with capsys.disabled():
        print(
            f"\nBF16 engine A vs R in BF16: before its rebalances {agreement['before'][0]}/8 "
            f"prompts, {agreement['before'][1]}/256 tokens, first-step logits differ by "
            f"{before:.3f}; after 2 rebalances (version {passes['after']['routed_version']}) "
            f"{agreement['after'][0]}/8 prompts, {agreement['after'][1]}/256 tokens, by "
            f"{after:.3f}; tolerance (R in BF16 vs float32) {bf16_error:.3f}"
        )
    assert before == 0.0 and agreement["before"] == (PROMPTS, PROMPTS * 32)
    assert passes["after"]["routed_version"] == 2 * CHUNKS
    assert after <= bf16_error
