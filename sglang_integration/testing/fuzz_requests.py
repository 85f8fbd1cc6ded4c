"""Hypothesis strategies for requests a daemon must survive: malformed, mistyped, must-fail.

Shared by ``tests/test_daemon_fuzz.py`` and ``sglang_integration.testing.daemon_fuzz``
(``scripts/fuzz_daemon.py``). The geometry is the model-less daemon's small one; ``HOLDER`` is the
engine the fuzz test keeps attached with its move of ``PENDING_LAYERS`` pending.
"""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import strategies as st

from layout_ledger.core.rules import MAX_ENGINE_ID
from layout_ledger.wire import protocol as msg

LAYERS, LOGICAL, PHYSICAL = 4, 8, 10
HOLDER = "engine-holder"
PENDING_LAYERS = [0, 1]
MAX_FRAME = 256 * 1024 * 1024  # sglang's recv_msg cap

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=5),
    ),
    max_leaves=12,
)
huge_int_list = st.integers(min_value=5_000, max_value=200_000).map(lambda n: list(range(n)))
# Ids that would forge terminal output, or hide: control, format and separator characters.
unprintable_engine_ids = st.tuples(
    st.text(max_size=12),
    st.sampled_from(["\n", "\r", "\x1b[2K", "\x00", "\t", "\u202e", "\u200b", "\u2028", "\x85"]),
    st.text(max_size=12),
).map("".join)
bad_engine_ids = st.one_of(
    st.just(""),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=3),
    st.integers(min_value=MAX_ENGINE_ID + 1, max_value=50_000).map(lambda n: "e" * n),
    unprintable_engine_ids,
)
# Engine ids that exist nowhere on the daemon (the holder is the only attached engine).
strangers = st.text(min_size=1, max_size=12).filter(lambda text: text != HOLDER)
any_engine_id = st.one_of(bad_engine_ids, strangers, junk)
layers_values = st.one_of(
    junk,
    huge_int_list,
    st.lists(st.integers(min_value=-3, max_value=LAYERS + 3), max_size=8),
)
row_values = st.one_of(
    junk,
    huge_int_list,
    st.lists(st.integers(min_value=-2, max_value=LOGICAL + 2), min_size=0, max_size=PHYSICAL + 2),
)
rows_values = st.one_of(
    junk,
    st.dictionaries(st.one_of(st.integers(-2, LAYERS + 2), scalars), row_values, max_size=4),
)


def would_commit(rows: Any) -> bool:
    """True for the one shape that is a valid commit of the holder's pending move."""
    return (
        isinstance(rows, dict)
        and set(rows) == set(PENDING_LAYERS)
        and all(type(layer) is int for layer in rows)
        and all(
            isinstance(row, (list, tuple))
            and len(row) == PHYSICAL
            and all(type(v) is int and 0 <= v < LOGICAL for v in row)
            for row in rows.values()
        )
    )


def with_missing_fields(fields: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``fields`` with any subset of its keys dropped."""
    keys = sorted(fields)
    return st.sets(st.sampled_from(keys)).map(
        lambda dropped: {k: v for k, v in fields.items() if k not in dropped}
    )


def layout_request(kind: str, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({name: strategy for name, strategy in fields.items()}).flatmap(
        lambda drawn: with_missing_fields(drawn).map(lambda present: {"type": kind, **present})
    )


def fetch_requests(config: dict[str, Any]) -> st.SearchStrategy[Any]:
    field = st.one_of(
        junk,
        st.fixed_dictionaries(
            {"engine_id": st.one_of(st.none(), any_engine_id), "version": junk, "digest": junk}
        ),
        st.fixed_dictionaries(
            {
                "engine_id": st.just(HOLDER),
                "version": st.integers(),
                "digest": st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
            }
        ),
    )
    right_config = st.just(config)
    wrong_config = st.one_of(
        junk,
        st.just({**config, "tp_size": 3}),
        st.just({k: v for k, v in config.items() if k != "dtype"}),
    )
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("fetch_state"), "config": right_config}),
        st.fixed_dictionaries(
            {"type": st.just("fetch_state"), "config": right_config, "expert_layout": field}
        ),
        st.fixed_dictionaries(
            {"type": st.just("fetch_state"), "config": wrong_config, "expert_layout": field}
        ),
        st.just({"type": "fetch_state"}),
    )


def malformed_frames() -> st.SearchStrategy[bytes]:
    """Bytes that are not one whole request: garbage, framed garbage, bad and lying sizes."""
    return st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=64).map(lambda b: struct.pack("!I", len(b)) + b),
        st.integers(MAX_FRAME + 1, 2**32 - 1).map(lambda n: struct.pack("!I", n)),
        st.tuples(st.integers(65, 10**6), st.binary(max_size=64)).map(
            lambda sized: struct.pack("!I", sized[0]) + sized[1]
        ),
    )


def requests_strategy(
    config: dict[str, Any], attach_ids: st.SearchStrategy[Any] | None = None
) -> st.SearchStrategy[Any]:
    """One malformed or must-fail request: ("msg", object) or ("raw", bytes).

    ``attach_ids``: the ids of the attach requests (default: bad ids and ``HOLDER``); each must
    be refused, or the short connection's end would detach the engine it attached.
    """
    if attach_ids is None:
        attach_ids = st.one_of(bad_engine_ids, st.just(HOLDER))
    holder_commit = layout_request(
        msg.COMMIT,
        engine_id=st.just(HOLDER),
        rows=rows_values.filter(lambda r: not would_commit(r)),
    )
    messages = st.one_of(
        layout_request(msg.ATTACH, engine_id=attach_ids),
        layout_request(
            msg.BEGIN,
            engine_id=st.one_of(any_engine_id, st.just(HOLDER)),
            base_version=junk,
            layers=layers_values,
        ),
        layout_request(msg.COMMIT, engine_id=any_engine_id, rows=rows_values),
        holder_commit,
        layout_request(msg.ABORT, engine_id=any_engine_id),
        st.just({"type": msg.QUERY}),
        st.just({"type": "ping"}),
        fetch_requests(config),
        st.fixed_dictionaries({"type": st.one_of(st.text(max_size=30), junk)}),
        st.dictionaries(st.text(max_size=6), junk, max_size=4),
        junk,
    )
    return st.one_of(
        messages.map(lambda m: ("msg", m)),
        malformed_frames().map(lambda b: ("raw", b)),
    )
