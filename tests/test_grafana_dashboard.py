"""The Grafana dashboard (docs/grafana-dashboard.json) asks only for what the exporter writes.

Every query's series are series ``layout-ledger metrics`` writes, every label it groups or
filters by is one those series carry (``role``: the place kept for attachment roles), the
data source is the dashboard's own variable, and the views the runbook needs are there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from engine_ledgers import EngineLedgers
from prometheus_client.parser import text_string_to_metric_families

from layout_ledger.cli.commands.metrics import collect_metrics, exposition

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
# Labels a query may use that no sample here carries: Prometheus' own, and the attachment role
# (metrics.attached_engine_counts: present once attachments carry roles).
OTHER_LABELS = {"instance", "job", "role", "digest"}


def _panels(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def _written(tmp_path: Path) -> tuple[set[str], set[str]]:
    ledgers = EngineLedgers(tmp_path, 2)
    try:
        ledgers.records[0].cordon_moves("drain")
        text = exposition(collect_metrics(ledgers.paths, {"engine": "e1"})).decode()
    finally:
        ledgers.close()
    names, labels = set(), set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def test_every_query_names_only_series_and_labels_the_exporter_writes(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    names, labels = _written(tmp_path)
    queries = [target["expr"] for panel in _panels(dashboard) for target in panel["targets"]]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"][1:]]
    assert queries
    for query in queries:
        used = set(re.findall(r"sglang_expert_layout_[a-z_]+", query))
        assert used and used <= names, (query, used - names)
        grouped = {
            label.strip()
            for group in re.findall(r"\bby \(([^)]*)\)", query)
            for label in group.split(",")
        }
        matched = set(re.findall(r"\b([a-z_]+)=~?\"", query))
        assert grouped | matched <= labels | OTHER_LABELS, query


def test_the_dashboard_is_one_engine_at_a_time_on_its_own_data_source_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["engine"]["definition"] == "label_values(sglang_expert_layout_version, engine)"
    panels = _panels(dashboard)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        for target in panel["targets"]:
            assert 'engine=~"$engine"' in target["expr"], target["expr"]
    titles = " | ".join(panel["title"] for panel in panels).lower()
    for view in (
        "versions per rank",
        "dirty, pending",
        "moves over time",
        "refusals",
        "daemon up",
        "attached engines by role",
    ):
        assert view in titles, view
