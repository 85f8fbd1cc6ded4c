"""The alerting rules (docs/prometheus-alerts.yml) checked and unit-tested by promtool itself.

``promtool check rules`` and ``promtool test rules tests/promtool/alerts_test.yml`` run when
promtool is installed (Debian and Ubuntu: ``apt-get install prometheus``); without it these two
tests are skipped, saying so, and the rest of the suite needs nothing of it. The series the
rules and their tests name are checked against what the exporter writes either way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from engine_ledgers import EngineLedgers

from layout_ledger.cli.commands.metrics import collect_metrics, exposition

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "prometheus-alerts.yml"
RULE_TESTS = ROOT / "tests" / "promtool" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (apt-get install prometheus): the alerting rules were not "
    "checked by promtool, nor their unit tests in tests/promtool/alerts_test.yml run",
)


def _promtool(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *argv], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


@needs_promtool
def test_promtool_checks_the_rules():
    result = _promtool("check", "rules", str(RULES), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_of_every_alert_pass():
    result = _promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_names_only_series_the_exporter_writes(tmp_path):
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {check["alertname"] for case in cases for check in case["alert_rule_test"]}
    fired = {
        check["alertname"]
        for case in cases
        for check in case["alert_rule_test"]
        if check["exp_alerts"]
    }
    names = {rule["alert"] for rule in rules}
    assert tested == fired == names
    ledgers = EngineLedgers(tmp_path, 1)
    try:
        text = exposition(collect_metrics(ledgers.paths)).decode()
    finally:
        ledgers.close()
    written = set(re.findall(r"^(sglang_expert_layout_[a-z_]+)", text, flags=re.MULTILINE))
    used = set(re.findall(r"sglang_expert_layout_[a-z_]+", RULES.read_text()))
    used |= set(re.findall(r"sglang_expert_layout_[a-z_]+", RULE_TESTS.read_text()))
    assert used <= written, used - written
