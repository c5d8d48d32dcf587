"""The ResidencyBoard's merge of replica reports, as /v1/models shows it (plain Python, no Ray)."""

import time

from serve.deployments.board import ResidencyBoard


def test_a_variant_shows_the_best_tier_any_live_replica_holds():
    board = ResidencyBoard(stale_after_s=60)
    board.report("r1", {"a": "cpu", "b": "device"})
    board.report("r2", {"a": "device"})
    assert board.residency() == {"a": "device", "b": "device"}
    board.report("r2", {})  # r2 evicted a
    assert board.residency() == {"a": "cpu", "b": "device"}
    board.forget("r1")
    assert board.residency() == {}


def test_a_replica_that_stops_reporting_drops_off():
    board = ResidencyBoard(stale_after_s=0.05)
    board.report("gone", {"a": "device"})
    time.sleep(0.1)
    board.report("alive", {"b": "cpu"})
    assert board.residency() == {"b": "cpu"}
