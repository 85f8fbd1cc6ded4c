"""The runbook is where messages and alerts send an operator: every section they name exists.

Every alert of docs/prometheus-alerts.yml has a ``runbook_url`` whose anchor is a heading of
docs/operations.md (GitHub's anchors), and the runbook has a section for every alert; every
section a CLI message names (``layout_ledger.cli.runbook``) is a heading of the page, and every
link within the docs lands on a file and one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layout_ledger.cli import runbook

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / runbook.RUNBOOK
RULES = ROOT / "docs" / "prometheus-alerts.yml"


def _headings() -> list[str]:
    return [
        line.lstrip("#").strip()
        for line in RUNBOOK.read_text().splitlines()
        if re.match(r"^#{1,6} ", line)
    ]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` dropped, spaces ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _alerts() -> list[dict[str, object]]:
    yaml = pytest.importorskip("yaml")
    rules: list[dict[str, object]] = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    return rules


def test_every_alerts_runbook_url_names_a_section_of_the_runbook():
    anchors = {anchor(heading) for heading in _headings()}
    for rule in _alerts():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        url = annotations.get("runbook_url")
        assert isinstance(url, str), f"{rule['alert']} has no runbook_url"
        page, _, fragment = url.partition("#")
        assert page == runbook.RUNBOOK
        assert fragment in anchors, f"{rule['alert']}: no section #{fragment}"


def test_the_runbook_has_a_section_for_every_alert():
    headings = set(_headings())
    missing = [rule["alert"] for rule in _alerts() if rule["alert"] not in headings]
    assert missing == []


@pytest.mark.parametrize("section", runbook.SECTIONS)
def test_every_section_a_cli_message_names_is_a_heading_of_the_runbook(section):
    assert section in _headings()


def test_every_link_within_the_runbook_lands_on_one_of_its_headings():
    anchors = {anchor(heading) for heading in _headings()}
    links = re.findall(r"\]\(#([^)]+)\)", RUNBOOK.read_text())
    assert links
    assert sorted(set(links) - anchors) == []


def test_every_relative_link_of_the_docs_lands_on_a_file_and_its_heading():
    broken = []
    for document in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, fragment = target.partition("#")
            linked = document if not path else document.parent / path
            if not linked.exists():
                broken.append((document.name, target))
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
                if fragment not in {anchor(heading) for heading in headings}:
                    broken.append((document.name, target))
    assert broken == []
