"""The restore rule, pure: from the findings of one engine's daemons, one verdict for all.

``layout_ledger.core.restore_verdict.decide`` is what every daemon applies to the same
all-gathered list (tests/test_restore_agreement.py runs it over real gloo groups).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from layout_ledger.core.layout import Geometry, layout_digest, trivial_map
from layout_ledger.core.restore_verdict import (
    LoadInitial,
    OfferKind,
    Restore,
    RestoreFinding,
    decide,
)
from layout_ledger.core.state import RestoredFrom

GEOMETRY = Geometry(3, 10, 8)
INITIAL = trivial_map(3, 10, 8)
CHECKPOINT = "c" * 64


def moved(shift: int) -> list[list[int]]:
    return [[(slot + shift) % 8 for slot in range(10)] for _ in range(3)]


def finding(rank: int, kind: OfferKind = OfferKind.OFFER, **fields: Any) -> RestoreFinding:
    values: dict[str, Any] = {
        "rank": rank,
        "ledger": f"/l{rank}.sqlite",
        "kind": kind,
        "checkpoint_digest": CHECKPOINT,
        "geometry": GEOMETRY,
        "initial_digest": layout_digest(INITIAL),
    }
    values.update(fields)
    return RestoreFinding(**values)


def offer(rank: int, version: int, the_map: list[list[int]], incarnation: int = 4) -> Any:
    return finding(
        rank,
        incarnation=incarnation,
        version=version,
        digest=layout_digest(the_map),
        physical_to_logical_map=the_map,
    )


def test_all_restore_the_newest_version_any_committed_with_the_holders_rows() -> None:
    # rank 1's mover died between its commits: rank 0 committed version 6, rank 1 holds 5,
    # rank 2's ledger is new (a replaced GPU)
    findings = [
        offer(0, 6, moved(2), incarnation=7),
        offer(1, 5, moved(1), incarnation=3),
        finding(2, OfferKind.NOTHING, reason="no earlier version"),
    ]
    verdict = decide(findings)
    assert isinstance(verdict, Restore)
    assert (verdict.version, verdict.physical_to_logical_map) == (6, moved(2))
    assert verdict.digest == layout_digest(moved(2))
    assert verdict.restored_from(findings[0]) == RestoredFrom(7, 6, verdict.digest)
    from_holder = RestoredFrom(7, 6, verdict.digest, source="rank 0's ledger /l0.sqlite")
    assert verdict.restored_from(findings[1]) == from_holder
    assert verdict.restored_from(findings[2]) == from_holder


def test_the_verdict_depends_only_on_the_set_of_findings() -> None:
    findings = [offer(0, 6, moved(2)), offer(1, 6, moved(2), incarnation=9), offer(2, 5, moved(1))]
    verdicts = {repr(decide(list(order))) for order in itertools.permutations(findings)}
    assert len(verdicts) == 1
    (only,) = verdicts
    assert "version=6" in only and "rank=0" in only  # the lowest rank holding it


def test_one_version_with_two_maps_restores_nothing() -> None:
    verdict = decide([offer(0, 3, moved(1)), offer(1, 3, moved(2)), offer(2, 2, moved(3))])
    assert isinstance(verdict, LoadInitial) and verdict.warn
    assert verdict.reason.startswith("the ledgers name version 3 with different maps: rank 0")


@pytest.mark.parametrize(
    ("odd", "reason"),
    [
        (finding(1, OfferKind.UNREADABLE, reason="not a ledger"), "a ledger cannot be read"),
        (finding(1, OfferKind.INITIAL, reason="x"), "--expert-layout-restore initial on rank 1"),
        (finding(1, checkpoint_digest="d" * 64), "the daemons of this engine load different "),
        (finding(1, geometry=Geometry(3, 12, 8)), "load different geometries"),
        (finding(1, initial_digest=layout_digest(moved(1))), "load different initial layouts"),
    ],
)
def test_a_daemon_that_cannot_agree_makes_every_daemon_load_the_initial_layout(
    odd: RestoreFinding, reason: str
) -> None:
    verdict = decide([offer(0, 4, moved(1)), odd])
    assert isinstance(verdict, LoadInitial) and verdict.warn
    assert reason in verdict.reason


def test_no_offer_names_each_ledgers_reason() -> None:
    verdict = decide(
        [
            finding(0, OfferKind.NOTHING, reason="no earlier version"),
            finding(1, OfferKind.NOTHING, reason="incarnation 2 has another geometry"),
        ]
    )
    assert verdict == LoadInitial(
        "nothing to restore: rank 0 (ledger /l0.sqlite): no earlier version; rank 1 (ledger "
        "/l1.sqlite): incarnation 2 has another geometry"
    )


def test_version_0_is_never_restored_it_is_the_initial_layout_or_refused() -> None:
    same = decide([offer(0, 0, INITIAL), offer(1, 0, INITIAL)])
    assert isinstance(same, LoadInitial) and not same.warn  # nothing to do, said at info
    other = decide([offer(0, 0, moved(1))])
    assert isinstance(other, LoadInitial) and other.warn
    assert "a version 0 other than this daemon's initial layout" in other.reason


def test_an_offered_map_that_does_not_give_its_digest_restores_nothing() -> None:
    forged = finding(0, incarnation=2, version=3, digest=layout_digest(moved(2)))
    forged = RestoreFinding(**{**forged.__dict__, "physical_to_logical_map": moved(1)})
    verdict = decide([forged])
    assert isinstance(verdict, LoadInitial)
    assert "rows that do not verify" in verdict.reason
    wrong_shape = RestoreFinding(
        **{**forged.__dict__, "physical_to_logical_map": [[0] * 10], "digest": "0" * 64}
    )
    assert isinstance(decide([wrong_shape]), LoadInitial)
