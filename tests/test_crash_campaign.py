"""A short run of scripts/crash_campaign.py: the daemon SIGKILLed mid-stream and restarted on
the same ledger, a reader holding snapshots meanwhile; nothing acknowledged is lost, every
restart derives the state the engine saw, verify passes. (The full campaign, 1,000 kills at
DeepSeek-V3 scale, is a script; its table is in docs/benchmarks.md.)"""

from __future__ import annotations

import pytest

from crash_campaign import SMALL, ok, render, run_campaign

pytestmark = pytest.mark.timeout(300)


def test_a_short_crash_campaign_loses_nothing_and_derives_every_state_right(tmp_path):
    tally = run_campaign(tmp_path, kills=4, geometry=SMALL, seed=7)
    assert tally.kills == 4 and tally.acknowledged > 0
    assert ok(tally), render(tally, SMALL, 0)
