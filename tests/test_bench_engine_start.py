"""``scripts/bench_engine.py`` section (c): how the engine start's stage calls become figures.

Two ranks' stage calls as the rank processes record them (``_timed_start_stages``: entered and
left on the one system-wide monotonic clock, and how deep in other timed calls); the rules of
``start_figures``: the start runs from the last rank's arrival to the last rank's end, the
figures are the rank that ended last, a stage counts without the stages inside it (sglang's
``init_by_mapping`` inside "adopt the map"), every ``init_by_mapping`` call counts, and a
collective's wait for the other ranks to arrive is shown apart.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench_engine import (
    ADOPT,
    ENGINE_ID,
    GATHER,
    GROUP,
    INIT_BY_MAPPING,
    median_start_figures,
    projected_start,
    start_figures,
)


def _rank(
    rank: int, started: float, ended: float, calls: list[tuple[str, float, float, int]]
) -> dict[str, Any]:
    return {"rank": rank, "startup": (started, ended), "stages": calls}


def test_the_start_is_cut_to_the_last_arrival_and_nested_stages_count_once() -> None:
    first = _rank(  # arrives last, at 0.1
        0, 0.1, 1.0, [(ENGINE_ID, 0.1, 0.15, 0), (GATHER, 0.4, 0.5, 0), (ADOPT, 0.55, 0.9, 0)]
    )
    last = _rank(  # ends last, at 1.2
        1,
        0.0,
        1.2,
        [
            (ENGINE_ID, 0.0, 0.15, 0),  # its 0.1 before rank 0 arrived is not the start's
            (GATHER, 0.3, 0.5, 0),  # waits 0.1 for rank 0 to arrive at 0.4
            (ADOPT, 0.6, 1.1, 0),
            (INIT_BY_MAPPING, 0.7, 0.8, 1),
            (INIT_BY_MAPPING, 0.85, 0.95, 1),
        ],
    )
    figures = start_figures([first, last])
    assert figures["rank"] == 1
    assert figures["whole"] == pytest.approx(1.1)  # 0.1 (last arrival) to 1.2 (last end)
    assert figures["sglang"] == pytest.approx(0.2)  # both calls
    assert figures["init_calls"] == 2
    assert figures["own"] == pytest.approx(0.9)
    assert figures["stages"] == pytest.approx({ENGINE_ID: 0.05, GATHER: 0.2, ADOPT: 0.3})
    assert figures["waits"] == pytest.approx({ENGINE_ID: 0.0, GATHER: 0.1})
    assert figures["elsewhere"] == pytest.approx(1.1 - 0.05 - 0.2 - 0.5)


def _start(rank: int, own: float, received: int) -> dict[str, Any]:
    """One rank's start whose only stage is the findings' all-gather, ``own`` seconds long."""
    return {
        **_rank(rank, 0.0, own, [(GATHER, 0.0, own, 0)]),
        "received": received,
        "collectives": 3,
    }


def test_figures_are_medians_over_the_starts_bytes_those_of_the_rank_receiving_most() -> None:
    starts = [(0.010, 1400), (0.030, 1400), (0.020, 1400)]
    results = [
        {"rank": rank, "starts": [_start(rank, own, received + rank) for own, received in starts]}
        for rank in range(2)
    ]
    figures = median_start_figures(results)
    assert figures["starts"] == 3
    assert figures["own"] == pytest.approx(0.020)
    assert figures["own_each"] == pytest.approx([0.010, 0.030, 0.020])
    assert figures["stages"] == pytest.approx({GATHER: 0.020})
    assert figures["received"] == 1401  # rank 1 received a byte more
    assert figures["collectives"] == 3


def _figures(stages: dict[str, float], waits: dict[str, float], received: int) -> dict[str, Any]:
    return {"stages": stages, "waits": waits, "received": received, "elsewhere": 0.001}


def test_on_paper_collectives_grow_in_gloos_steps_other_stages_and_bytes_as_measured() -> None:
    """EP 2 -> 4: the broadcast 1 -> 2 steps, the gather through the first rank 2 -> 3; at EP
    64: 6 and 7 steps. The group (a store barrier) and the attach are one rank's work: the
    smaller figure, as outside the stages."""
    by_ep = {
        2: _figures({ENGINE_ID: 0.001, GATHER: 0.002, GROUP: 0.003, "attach": 0.004}, {}, 1400),
        4: _figures(
            {ENGINE_ID: 0.002, GATHER: 0.0035, GROUP: 0.005, "attach": 0.006},
            {GATHER: 0.0005},
            2800,
        ),
    }
    paper = projected_start(by_ep, ep=64)
    assert paper["received"] == pytest.approx(44800)  # 700 bytes a rank
    assert paper["stages"] == pytest.approx(
        {
            ENGINE_ID: 0.002 + 0.001 * 4,  # 1 ms a step: 2 -> 6 steps
            GATHER: 0.003 + 0.001 * 4,  # without its wait: 2 ms at 2 steps, 3 at 3; 7 steps
            GROUP: 0.005,  # its steps do not grow
            "attach": 0.004,
        }
    )
    assert paper["waits"] == pytest.approx(0.0005)
    assert paper["own"] == pytest.approx(sum(paper["stages"].values()) + 0.0005 + 0.001)


def test_the_own_time_less_cpu_waits_leaves_init_by_mappings_waits_out_of_it() -> None:
    """The rank waited 0.3 s for a CPU during its start, 0.15 of it inside sglang's
    init_by_mapping (already sglang's part): the plugin's own less its waits is 0.15 less."""
    last = {
        **_rank(
            0,
            0.0,
            1.0,
            [
                (GATHER, 0.1, 0.3, 0, 0.05),
                (ADOPT, 0.4, 1.0, 0, 0.2),
                (INIT_BY_MAPPING, 0.5, 0.8, 1, 0.15),
            ],
        ),
        "cpu_waits": 0.3,
    }
    figures = start_figures([last])
    assert figures["own"] == pytest.approx(0.7)
    assert figures["own_without_cpu_waits"] == pytest.approx(0.55)
    assert figures["cpu_waits"] == pytest.approx({GATHER: 0.05, ADOPT: 0.05})


def test_on_paper_each_stage_is_taken_less_its_own_waits_for_a_cpu() -> None:
    by_ep = {
        2: {**_figures({GATHER: 0.002, "attach": 0.004}, {}, 1400), "cpu_waits": {}},
        4: {
            **_figures({GATHER: 0.005, "attach": 0.009}, {}, 2800),
            "cpu_waits": {GATHER: 0.002, "attach": 0.006},
        },
    }
    paper = projected_start(by_ep, ep=64)
    assert paper["stages"] == pytest.approx({GATHER: 0.003 + 0.001 * 4, "attach": 0.003})
