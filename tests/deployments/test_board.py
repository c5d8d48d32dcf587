"""The ResidencyBoard's merge of replica reports, as /v1/models shows it (plain Python, no Ray)."""

import time

from serve.deployments.board import ResidencyBoard


def test_a_variant_shows_the_best_tier_any_live_replica_holds():
    board = ResidencyBoard(stale_after_s=60)
    board.report("r1", {"a": "warm", "b": "hot"})
    board.report("r2", {"a": "hot"})
    assert board.residency() == {"a": "hot", "b": "hot"}
    board.report("r2", {})  # r2 evicted a
    assert board.residency() == {"a": "warm", "b": "hot"}
    board.forget("r1")
    assert board.residency() == {}


def test_a_replica_that_stops_reporting_drops_off():
    board = ResidencyBoard(stale_after_s=0.05)
    board.report("gone", {"a": "hot"})
    time.sleep(0.1)
    board.report("alive", {"b": "warm"})
    assert board.residency() == {"b": "warm"}


def test_reports_go_out_in_the_background_and_a_board_that_hangs_costs_one_warning(caplog):
    import asyncio

    from serve.deployments.board import Reporter

    sent, hang = [], asyncio.Event()

    async def send(held):
        sent.append(held)
        if len(sent) == 1:
            await hang.wait()  # the first report never comes back

    async def go():
        reporter = Reporter(send, timeout_s=0.05)
        reporter.changed({"a": "hot"})  # returns at once: an answer never waits for the board
        assert sent == [] and not reporter._task.done()
        await reporter._task  # bounded by the timeout
        reporter.changed({"a": "hot", "b": "warm"})
        await reporter._task
        reporter.changed({"a": "hot", "b": "warm"})  # unchanged since the last report: nothing sent
        return reporter

    reporter = asyncio.run(go())
    assert reporter.failures == 1 and sent == [{"a": "hot"}, {"a": "hot", "b": "warm"}]
    assert [r.getMessage() for r in caplog.records] == ["residency report failed: timed out"]


def test_a_report_that_raises_never_reaches_the_request():
    import asyncio

    from serve.deployments.board import Reporter
    from serve.engine import faults

    async def send(held):
        raise AssertionError("the fault comes first")

    reporter = Reporter(send, before=lambda: faults.hit("report", ["lm"]))
    with faults.injected("report", "lm"):
        asyncio.run(reporter.report({"x": "hot"}))  # no exception escapes
    assert reporter.failures == 1 and faults.hits["report"] >= 1
