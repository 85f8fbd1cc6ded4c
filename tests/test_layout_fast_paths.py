"""The commit path's fast encodings are the protocol's JSON and the rules' checks, exactly.

``compact_json`` (orjson when present) must write the bytes ``json.dumps(..., separators=(",",
":"))`` writes, so every digest stays the protocol's; ``validate_rows_json`` must accept exactly
what ``validate_rows`` accepts and refuse the rest with its message.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_ledger.core.errors import InvalidRequest
from layout_ledger.core.layout import (
    Geometry,
    compact_json,
    layout_digest,
    row_json,
    validate_rows,
    validate_rows_json,
)

GEOMETRY = Geometry(num_layers=4, num_physical_slots=6, num_logical_experts=5)
LAYERS = (0, 2, 3)


@given(st.lists(st.lists(st.integers(0, 2**63 - 1), max_size=20), max_size=10))
def test_compact_json_is_the_standard_librarys_compact_json(rows):
    assert compact_json(rows) == json.dumps(rows, separators=(",", ":")).encode()


def test_the_digest_of_a_huge_int_still_uses_the_protocols_json():
    assert layout_digest([[2**70]]) == layout_digest([[2**70]])
    assert compact_json([[2**70]]) == b"[[1180591620717411303424]]"


# Every kind of value sglang's SafeUnpickler lets a request carry (builtins: no int subclass but
# bool, which is refused; an IntEnum handed to the record in-process is taken as its value).
BAD_VALUES = [
    -1,
    5,
    255,
    256,
    300,
    2**64,
    True,
    False,
    1.0,
    math.nan,
    None,
    "1",
    b"1",
    [1],
    (1,),
    {1: 2},
    1j,
]
values = st.one_of(st.integers(0, 4), st.sampled_from(BAD_VALUES))
rows_strategy = st.dictionaries(
    st.sampled_from([0, 1, 2, 3, "0", 2.0]),
    st.one_of(st.lists(values, min_size=5, max_size=7), st.sampled_from(["0,1", None, (0,) * 6])),
    max_size=4,
)


@settings(max_examples=400, deadline=None)
@given(rows_strategy)
def test_the_fast_path_accepts_and_refuses_exactly_as_the_rules_do(rows):
    try:
        expected = {
            layer: row_json(row) for layer, row in validate_rows(rows, LAYERS, GEOMETRY).items()
        }
    except InvalidRequest as exc:
        with pytest.raises(InvalidRequest) as info:
            validate_rows_json(rows, LAYERS, GEOMETRY)
        assert str(info.value) == str(exc)
    else:
        assert validate_rows_json(rows, LAYERS, GEOMETRY) == expected
