"""``scripts/bench_forward.py``: its arguments, and how the ranks' pass records become the verdict.

The benchmark itself (two daemon groups, two engines, hundreds of decode steps) takes minutes, so
the suite checks what decides its figures: the arguments it refuses, the EPLB server args it
gives the engines (sglang's ``EPLBManager`` asserts the recorder's buffer is no longer than the
interval), how two ranks' records of one pass merge (the slower rank is the engine's step, the
chunk is collective), and the goal's verdict (median on - median off <= 1% of the off step).
"""

from __future__ import annotations

from typing import Any

import pytest

from bench_forward import (
    GOAL_SHARE,
    EngineRecord,
    Pass,
    compare,
    engine_figures,
    eplb_server_args,
    merge_ranks,
    parse_args,
    share_interval,
    token_lines,
)


@pytest.mark.parametrize(
    "argv",
    [
        ["--rounds", "1"],
        ["--segments", "0"],
        ["--new-tokens", "1"],
        ["--new-tokens", "81"],
        ["--interval", "0"],
        ["--model", "llama"],
    ],
)
def test_arguments_the_run_cannot_honour_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_args(argv)
    assert refused.value.code == 2
    assert "bench_forward.py" in capsys.readouterr().err


def test_defaults_interleave_hundreds_of_decode_steps_per_engine() -> None:
    args = parse_args([])
    assert args.model == "qwen3_moe"
    assert args.rounds >= 2
    assert args.rounds * args.segments * (args.new_tokens - 1) >= 500


def test_the_recorder_window_never_exceeds_the_rebalance_interval() -> None:
    for interval in (1, 10, 1000):
        given = dict(eplb_server_args(interval))
        assert given["eplb_rebalance_num_iterations"] == interval
        assert given["expert_distribution_recorder_buffer_size"] <= interval
    never = dict(eplb_server_args(10**9, window=1))
    assert never["expert_distribution_recorder_buffer_size"] == 1


def _record(kind: str, seconds: float, layers: int = 0, move: float = 0.0) -> list[Any]:
    return [kind, seconds, seconds / 2, 0.001, layers, move]


def test_a_pass_is_the_slower_ranks_and_its_chunk_is_both_ranks() -> None:
    ranks = [
        {"passes": [_record("decode", 0.010, 1, 0.002), _record("decode", 0.020)]},
        {"passes": [_record("decode", 0.012, 1, 0.003), _record("decode", 0.015)]},
    ]
    merged = merge_ranks(ranks)
    assert [p.seconds for p in merged] == [0.012, 0.020]
    assert [p.moved_layers for p in merged] == [1, 0]
    assert merged[0].move_seconds == 0.003
    assert merged[0].waits == pytest.approx(0.011 / 2 - 0.001)


@pytest.mark.parametrize(
    "second",
    [[_record("extend", 0.01)], [_record("decode", 0.01, 2)], []],
    ids=["kind", "chunk", "count"],
)
def test_ranks_that_disagree_on_a_pass_are_an_error(second: list[Any]) -> None:
    with pytest.raises(RuntimeError):
        merge_ranks([{"passes": [_record("decode", 0.01, 1)]}, {"passes": second}])


def _engine(step: float, chunk_step: float, steps: int = 9, rounds: int = 1) -> EngineRecord:
    record = EngineRecord()
    for _ in range(rounds):
        passes = [Pass("extend", 1.0, 0.5, 0.0, 0.5, 0, 0.0)]
        passes += [Pass("decode", step, step, 0.0, 0.0, 0, 0.0) for _ in range(steps)]
        passes += [Pass("decode", chunk_step, chunk_step, 0.0, 0.0, 1, 0.001)]
        record.passes += passes
        record.round_steps.append([p.seconds for p in passes if p.kind == "decode"])
    return record


def test_the_goal_holds_within_one_percent_of_a_step_and_not_above() -> None:
    off = _engine(0.100, 0.150)
    met = compare(_engine(0.100 * (1 + GOAL_SHARE / 2), 0.150), off)
    assert met.met
    assert met.added == pytest.approx(0.100 * GOAL_SHARE / 2)
    missed = compare(_engine(0.100 * (1 + 2 * GOAL_SHARE), 0.150), off)
    assert not missed.met
    assert missed.share == pytest.approx(2 * GOAL_SHARE)


def test_prefill_passes_and_chunk_passes_are_apart_from_the_plain_step() -> None:
    on = engine_figures(_engine(0.100, 0.400))
    assert on["decode steps"] == 10
    assert on["steps without a chunk"] == 9
    assert on["median without a chunk"] == 0.100
    assert on["median with a chunk"] == 0.400
    assert on["extend passes"] == 1
    found = compare(_engine(0.100, 0.400), _engine(0.100, 0.200))
    assert found.added_no_chunk == 0.0
    assert found.chunk_hold == pytest.approx(0.300)


def test_the_interval_resamples_whole_rounds_of_both_engines() -> None:
    # Every round adds 2% on: whichever rounds are drawn, the share is 2%.
    on, off = _engine(0.102, 0.102, rounds=6), _engine(0.100, 0.100, rounds=6)
    low, high = share_interval(on, off) or (None, None)
    assert low == pytest.approx(0.02)
    assert high == pytest.approx(0.02)
    assert share_interval(_engine(0.1, 0.1), _engine(0.1, 0.1)) is None  # one round: none


def test_a_plugin_engine_whose_tokens_differ_from_off_or_the_reference_fails_the_run() -> None:
    right = {0: [[5, 6], [7, 8]]}
    wrong = {0: [[5, 6], [7, 9]]}
    records = {"on": EngineRecord(tokens=right), "off": EngineRecord(tokens=right)}
    lines, ok = token_lines(records, right)
    assert ok and lines[-1].endswith(": met")
    records["on"] = EngineRecord(tokens=wrong)
    lines, ok = token_lines(records, right)
    assert not ok and lines[-1].endswith("not met")
    assert "1/2 prompts equal" in lines[0]
    records = {"on": EngineRecord(tokens=right), "off": EngineRecord(tokens=right)}
    assert not token_lines(records, wrong)[1]  # the reference disagrees
    assert not token_lines({"on": EngineRecord(), "off": EngineRecord()}, {})[1]  # none compared
