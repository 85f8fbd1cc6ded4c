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

from bench_engine import ADOPT, ENGINE_ID, GATHER, INIT_BY_MAPPING, start_figures


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
