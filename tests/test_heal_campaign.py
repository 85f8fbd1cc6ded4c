"""A short run of scripts/heal_campaign.py: model-backed daemons SIGKILLed while they heal
(and between heals), restarted on the same ledgers; no acknowledged commit is lost, no clean
state has a wrong slot, every killed incarnation ends dirty or unknown and verifies. Its heal
rounds put the shard they read on a blocked or a slow FUSE mount (where this machine can mount
one): every request to the daemons is answered within 1 s meanwhile. (The full campaign, 200
kills, is a script; its table is in docs/daemon.md "Healing".)"""

from __future__ import annotations

import pytest

from heal_campaign import ok, render, run_campaign
from sglang_integration.testing.stalled_mount import fuse_available

pytestmark = pytest.mark.timeout(600)


def test_a_short_heal_campaign_loses_nothing_and_never_leaves_a_wrong_clean_state(tmp_path):
    shards = 0.5 if fuse_available() is None else 0.0
    tally = run_campaign(tmp_path, kills=4, seed=3, blocked=shards, slow=shards)
    assert tally.kills == 4
    assert ok(tally), render(tally, "qwen3_moe", 0)
    if shards:
        assert sum(tally.shard_rounds.values()) >= 1 and tally.asked > 0
