"""Thousands of random and malformed requests never crash the daemon or change its record.

A model-less daemon (sglang's real serve loop and request handling with the plugin, a real
ledger) runs in its own process, with one engine attached from this process and its move of
layers [0, 1] pending at version 1. Hypothesis then sends at least 2,000 requests that must all
fail: wrong types, missing fields, unknown types, huge layer lists, oversized engine ids,
commits with broken rows, fetches the layout check must refuse, pickles of arbitrary objects
and raw garbage bytes (the strategies are ``sglang_integration.testing.fuzz_requests``, which
``scripts/fuzz_daemon.py`` also draws from). Afterwards:

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

from layout_ledger.wire import protocol as msg
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    request,
    send_raw,
    start_daemon,
)
from sglang_integration.testing.daemon_fuzz import run_fuzz
from sglang_integration.testing.fuzz_requests import (
    HOLDER,
    LAYERS,
    LOGICAL,
    PENDING_LAYERS,
    PHYSICAL,
    requests_strategy,
)

pytestmark = pytest.mark.timeout(240)

REQUESTS_PER_EXAMPLE = 20
EXAMPLES = 110
REFUSAL_STATUSES = {msg.REFUSED, msg.BUSY, msg.LAYOUT_REFUSED}

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


def test_the_fuzz_scripts_core_finds_no_fault_in_a_short_run(tmp_path: Path) -> None:
    """``scripts/fuzz_daemon.py``'s core, 50 requests: valid and malformed, engines ending."""
    tally = run_fuzz(tmp_path, 50, seed=0, restart_every=30)
    assert tally.requests >= 50
    faults = (tally.daemon_crashes, tally.rule_breaks, tally.refused_changes)
    assert faults == (0, 0, 0), tally.problems
    assert tally.verify_failures == 0 and tally.verifies >= 2, tally.problems
