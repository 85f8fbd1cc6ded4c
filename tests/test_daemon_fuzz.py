"""Thousands of random and malformed requests never crash the daemon or change its record.

A model-less daemon (sglang's real serve loop and request handling with the plugin, a real
ledger) runs in its own process, with one engine attached from this process and its move of
layers [0, 1] pending at version 1. Hypothesis then sends at least 2,000 requests that must all
fail: wrong types, missing fields, unknown types, huge layer lists, oversized engine ids,
commits with broken rows, fetches the layout check must refuse, pickles of arbitrary objects
and raw garbage bytes. Afterwards:

- the daemon still answers ``ping``, and the engine is still attached with the same move pending
  (no malformed request closed its attach connection or touched its move);
- the ledger's layout record is unchanged: ``incarnations``, ``versions``, ``layout_rows`` and
  every event that is not a refusal audit entry; each request answered ``refused`` / ``busy``
  / ``layout_refused`` appended exactly one ``*_refused`` / ``begin_busy`` event, and nothing
  else appended any (docs/protocol.md: refusals are events; docs/design.md: an event row for
  every refusal);
- no reply was an ``error`` with a ``reason`` (the plugin's own failure path).
"""

from __future__ import annotations

import pickle
import sqlite3
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.daemon_control import (
    DaemonProcess,
    request,
    send_raw,
    start_daemon,
)
from layout_ledger import protocol as msg
from layout_ledger.rules import MAX_ENGINE_ID
from sglang_integration import client

pytestmark = pytest.mark.timeout(240)

LAYERS, LOGICAL, PHYSICAL = 4, 8, 10
HOLDER = "engine-holder"
PENDING_LAYERS = [0, 1]
REQUESTS_PER_EXAMPLE = 20
EXAMPLES = 110
REFUSAL_STATUSES = {msg.REFUSED, msg.BUSY, msg.LAYOUT_REFUSED}

# --- strategies ---------------------------------------------------------------------------------

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
bad_engine_ids = st.one_of(
    st.just(""),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=3),
    st.integers(min_value=MAX_ENGINE_ID + 1, max_value=50_000).map(lambda n: "e" * n),
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


def requests_strategy(config: dict[str, Any]) -> st.SearchStrategy[Any]:
    """One malformed or must-fail request: ("msg", object) or ("raw", bytes)."""
    holder_commit = layout_request(
        msg.COMMIT,
        engine_id=st.just(HOLDER),
        rows=rows_values.filter(lambda r: not would_commit(r)),
    )
    messages = st.one_of(
        layout_request(msg.ATTACH, engine_id=st.one_of(bad_engine_ids, st.just(HOLDER))),
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
    framed_garbage = st.binary(max_size=64).map(lambda b: struct.pack("!I", len(b)) + b)
    return st.one_of(
        messages.map(lambda m: ("msg", m)),
        st.binary(max_size=200).map(lambda b: ("raw", b)),
        framed_garbage.map(lambda b: ("raw", b)),
    )


# --- the ledger ---------------------------------------------------------------------------------


def record_rows(path: str) -> dict[str, list[tuple[Any, ...]]]:
    """The layout record, without the refusal audit entries."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        dump = {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("incarnations", "versions", "layout_rows")
        }
        dump["events"] = conn.execute(
            "SELECT * FROM events WHERE kind NOT LIKE '%\\_refused' ESCAPE '\\' "
            "AND kind != 'begin_busy' ORDER BY event_id"
        ).fetchall()
    return dump


def refusal_events(path: str) -> Counter[str]:
    """Refusals recorded, by kind (identical consecutive ones share a row and its count)."""
    counted: Counter[str] = Counter()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        for kind, count in conn.execute(
            "SELECT kind, count FROM events WHERE kind LIKE '%\\_refused' ESCAPE '\\' "
            "OR kind = 'begin_busy'"
        ):
            counted[kind] += count
    return counted


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    handle = start_daemon(
        tmp_path,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        extra=["--log-level", "CRITICAL"],  # thousands of logged failures would only cost time
    )
    yield handle
    handle.stop()


def _decode(raw: bytes) -> Any:
    if len(raw) < 4:
        return None
    (length,) = struct.unpack("!I", raw[:4])
    return pickle.loads(raw[4 : 4 + length])


def test_random_malformed_requests_never_crash_the_daemon_or_change_the_record(
    daemon: DaemonProcess,
) -> None:
    holder = client.attach(daemon.socket_path, HOLDER)
    assert holder.reply.ok
    assert client.begin(daemon.socket_path, HOLDER, 0, [2]).ok
    assert client.commit(daemon.socket_path, HOLDER, {2: [1] * PHYSICAL}).ok
    assert client.begin(daemon.socket_path, HOLDER, 1, PENDING_LAYERS).ok
    config = request(daemon.socket_path, {"type": "query_config"})["config"]
    before = record_rows(daemon.ledger_path)
    refusals_before = refusal_events(daemon.ledger_path)
    sent = 0
    statuses: Counter[str] = Counter()
    plugin_errors: list[Any] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(
            requests_strategy(config), min_size=REQUESTS_PER_EXAMPLE, max_size=REQUESTS_PER_EXAMPLE
        )
    )
    def send_all(batch: list[tuple[str, Any]]) -> None:
        nonlocal sent
        for how, payload in batch:
            if how == "raw":
                reply = _decode(send_raw(daemon.socket_path, payload))
            else:
                data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
                reply = _decode(send_raw(daemon.socket_path, struct.pack("!I", len(data)) + data))
            sent += 1
            if isinstance(reply, dict):
                statuses[str(reply.get("status"))] += 1
                if reply.get("status") == msg.ERROR and "reason" in reply:
                    plugin_errors.append((payload, reply))

    send_all()

    assert sent >= 2000
    assert plugin_errors == []
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}
    state = request(daemon.socket_path, {"type": msg.QUERY})["layout"]
    assert state["attached"] == [HOLDER] and holder.is_open
    assert state["pending"] == {"engine_id": HOLDER, "layers": PENDING_LAYERS, "base_version": 1}
    assert (state["version"], state["dirty"], state["non_following_fetch"]) == (1, False, False)
    assert record_rows(daemon.ledger_path) == before
    added = refusal_events(daemon.ledger_path) - refusals_before
    assert sum(added.values()) == sum(statuses[s] for s in REFUSAL_STATUSES)
    assert statuses[msg.REFUSED] > 100 and statuses[msg.LAYOUT_REFUSED] > 10

    # The engine's move is intact: it can still commit it.
    assert client.commit(
        daemon.socket_path, HOLDER, {layer: [0] * PHYSICAL for layer in PENDING_LAYERS}
    ).ok
    holder.close()
