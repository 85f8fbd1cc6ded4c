"""A short run of scripts/heal_campaign.py: model-backed daemons SIGKILLed while they heal
(and between heals), restarted on the same ledgers; no acknowledged commit is lost, no clean
state has a wrong slot, every killed incarnation ends dirty or unknown and verifies. (The full
campaign, 200 kills, is a script; its table is in docs/daemon.md "Healing".)"""

from __future__ import annotations

import pytest

from heal_campaign import ok, render, run_campaign

pytestmark = pytest.mark.timeout(300)


def test_a_short_heal_campaign_loses_nothing_and_never_leaves_a_wrong_clean_state(tmp_path):
    tally = run_campaign(tmp_path, kills=4, seed=3)
    assert tally.kills == 4
    assert ok(tally), render(tally, "qwen3_moe", 0)
