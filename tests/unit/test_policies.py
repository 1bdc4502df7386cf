"""Which policy applies to a topic, and whether dedup can apply anywhere."""

from __future__ import annotations

import pytest

from dedup.policies import Mode, PolicySnapshot

pytestmark = pytest.mark.unit


def test_most_specific_policy_wins() -> None:
    snapshot = PolicySnapshot(
        default=Mode.ENABLED,
        global_mode=Mode.DISABLED,
        prefixes={"team.": Mode.ENABLED, "team.audit.": Mode.REQUIRE},
        topics={"team.audit.raw": Mode.DISABLED},
    )
    assert snapshot.mode_for("other") is Mode.DISABLED  # global beats the default
    assert snapshot.mode_for("team.orders") is Mode.ENABLED  # prefix beats global
    assert snapshot.mode_for("team.audit.log") is Mode.REQUIRE  # longest prefix wins
    assert snapshot.mode_for("team.audit.raw") is Mode.DISABLED  # topic beats prefixes
    assert PolicySnapshot(default=Mode.DISABLED).mode_for("x") is Mode.DISABLED


def test_policy_snapshot_knows_when_no_topic_can_have_dedup() -> None:
    assert not PolicySnapshot(default=Mode.DISABLED).dedup_anywhere
    assert PolicySnapshot(default=Mode.ENABLED).dedup_anywhere
    assert not PolicySnapshot(default=Mode.ENABLED, global_mode=Mode.DISABLED).dedup_anywhere
    assert PolicySnapshot(default=Mode.DISABLED, prefixes={"a.": Mode.REQUIRE}).dedup_anywhere
    assert PolicySnapshot(default=Mode.DISABLED, topics={"t": Mode.ENABLED}).dedup_anywhere
    snapshot = PolicySnapshot(
        default=Mode.DISABLED, global_mode=Mode.ENABLED, topics={"t": Mode.DISABLED}
    )
    assert snapshot.dedup_anywhere and snapshot.mode_for("t") is Mode.DISABLED
    assert snapshot.mode_for("other") is Mode.ENABLED
