"""`manyfold store upgrade` on tiny models: four tenants' adapters move from one base to another, the upgrade is
interrupted and resumed, each name switches where the guard kept its transfer, a request in flight across a switch
is answered by one base or the other, and a rollback points every name back."""

import asyncio
import json
from pathlib import Path

import pytest

from serve.adapters import translora, upgrade
from serve.adapters.transfer_guard import TransferFailed
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import write_tiny_causal

DECISIONS = {"t1": "student", "t2": "fail", "t3": "unchanged", "t4": "student"}
"""What the guard decides for each tenant's transfer (tests/adapters/test_transfer_guard.py tests the guard)."""
OPTIONS = {"samples": 2, "max_attempts": 48, "steps": 2}


@pytest.fixture
def store(bases, source_adapter, tmp_path) -> Store:
    """Two bases of one architecture and tokenizer (the source adapter fits both), a tenant's adapter each on
    the old one."""
    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("llama2", write_tiny_causal(tmp_path / "llama2", seed=7))
    for tenant in DECISIONS:
        variant_kind("pissa").add(store, tenant, "llama", source_adapter)
    return store


@pytest.fixture
def transfers(store, monkeypatch) -> list[str]:
    """Real transfers on the tiny models, the guard's decision made by tenant; -> the tenants transferred, in turn.
    Its stop_at (a call number) raises KeyboardInterrupt there, as an operator's Ctrl-C would."""
    calls = Calls()
    real = translora.transfer
    tenant_of = {Path(store.variant_dir(t)): t for t in DECISIONS}

    def transfer(source_base, adapter_dir, *args, **kwargs):
        tenant = tenant_of[Path(adapter_dir)]
        calls.append(tenant)
        if len(calls) == calls.stop_at:
            raise KeyboardInterrupt
        if DECISIONS[tenant] == "fail":
            raise TransferFailed("no better than the target alone (validation loss: student 4.1, target 4.0)")
        monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: DECISIONS[tenant])
        return real(source_base, adapter_dir, *args, **kwargs)

    monkeypatch.setattr(translora, "transfer", transfer)
    return calls


class Calls(list):
    stop_at: int | None = None


def test_an_interrupted_upgrade_resumes_redoing_nothing_and_switches_the_names_the_guard_kept(store, transfers,
                                                                                            tmp_path):
    report_path, lines = tmp_path / "upgrade.json", []
    transfers.stop_at = 3  # stopped during the third tenant's transfer
    with pytest.raises(KeyboardInterrupt):
        upgrade.upgrade(store, "llama", "llama2", report_path, say=lines.append, **OPTIONS)
    assert transfers == ["t1", "t2", "t3"]
    assert store.manifest.aliases == {"t1": "t1.llama2"}  # t2's transfer failed: its name stays
    first = json.loads(report_path.read_text())
    assert [(t["name"], t["decision"], t["switched"]) for t in first["tenants"]] == [
        ("t1", "moved", True), ("t2", "failed", False)]
    assert any(line.startswith("[1/4] t1: student training") for line in lines)

    transfers.stop_at = None
    report = upgrade.upgrade(store, "llama", "llama2", report_path, say=lines.append, **OPTIONS)
    assert transfers == ["t1", "t2", "t3", "t2", "t3", "t4"]  # t1, done, not redone; what failed is tried again
    assert store.manifest.aliases == {"t1": "t1.llama2", "t3": "t3.llama2", "t4": "t4.llama2"}
    assert {t["name"]: (t["decision"], t["switched"]) for t in report["tenants"]} == {
        "t1": ("moved", True), "t2": ("failed", False), "t3": ("kept", True), "t4": ("moved", True)}
    assert report["tenants"][0]["minutes"] == first["tenants"][0]["minutes"]  # the run that did it measured it
    assert report["tenants"][0]["compared"]["student"] is not None  # the figures the guard compared
    assert json.loads(report_path.read_text()) == report
    assert store.variant("t3.llama2").translora == "unchanged" and store.variant("t1.llama2").base == "llama2"

    assert upgrade.upgrade(store, "llama", "llama2", report_path, say=lines.append, **OPTIONS)["tenants"][0][
        "switched"] and transfers[6:] == ["t2"]  # a third run: only the failed one is tried again
    assert upgrade.rollback(store, "llama", "llama2") == ["t1", "t3", "t4"]
    assert store.manifest.aliases == {}
    assert upgrade.rollback(store, "llama", "llama2") == []


def test_a_dry_run_says_what_would_move_and_changes_nothing(store):
    before = store.manifest
    lines = upgrade.dry_run(store, "llama", "llama2", samples=64)
    assert lines[0] == "upgrade llama -> llama2: 4 tenant adapters, 4 to transfer"
    assert lines[1].startswith("  t1: t1 -> t1.llama2: to transfer (~") and lines[-1].startswith("about ")
    assert store.manifest == before
    for t in ("t1", "t2", "t3", "t4"):  # every tenant transferred (their own adapters stand in for the moves)
        variant_kind("pissa").add(store, f"{t}.llama2", "llama2", store.variant_dir(t))
    lines = upgrade.dry_run(store, "llama", "llama2", samples=64)
    assert lines[0].endswith("4 tenant adapters, 0 to transfer") and "not switched" in lines[1]
    assert lines[-1] == "nothing to transfer: every tenant that can move has been transferred"


@pytest.mark.parametrize("flags, most", [
    ([], 10 * (1 + upgrade.SECOND_STUDENT)),  # a second student may train
    (["--filtered-only"], 10),  # one student
    (["--budget-min", "12"], 12),  # never beyond the budget
])
def test_a_dry_runs_estimate_counts_the_second_student_a_transfer_may_train(store, monkeypatch, capsys, flags, most):
    from serve.cli import main

    monkeypatch.setattr(upgrade, "minutes_each", lambda *args: 10.0)  # one student's transfer: 10 minutes
    assert main(["store", "upgrade", "--store", str(store.root), "--from", "llama", "--to", "llama2", "--dry-run",
                 *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    each, whole = (f"10-{most:.0f}", f"40-{4 * most:.0f}") if most > 10 else ("10", "40")  # four tenants
    assert lines[1].endswith(f": to transfer (~{each} min)")
    assert lines[-1].startswith(f"about {whole} minutes here in all (~{each} a transfer")
    assert ("second student" in lines[-1]) == (most > 10)


def test_a_request_in_flight_across_the_switch_is_answered_by_the_base_it_was_resolved_on(store, source_adapter):
    """t1 on the old base and its transfer on the new one (the source adapter itself here: where it lands is
    beside the point): a stream begun before the switch ends as the old base answers, one begun after is the new
    base's, and a rollback gives the old base's again; /v1/models says which base answers the name."""
    variant_kind("pissa").add(store, "t1.llama2", "llama2", source_adapter)
    engine = Engine(ServeConfig(store=str(store.root), store_refresh_s=3600))  # it looks when told to
    greedy = SamplingParams(max_tokens=12, temperature=0)
    writer = Store(store.root)  # the upgrade's own view of the store, as another process would hold it

    async def text(model: str) -> str:
        return (await engine.complete(model, greedy, prompt="the cat sat on")).text

    async def run() -> tuple:
        old, new = await text("t1"), await text("t1.llama2")
        stream = engine.complete_stream("t1", greedy, prompt="the cat sat on")
        pieces = [await anext(stream)]  # in flight, on the old base
        upgrade.point(writer, {"t1": "t1.llama2"})
        await engine.catalog.refresh()
        switched = {m.name: (m.base, m.alias_of) for m in engine.model_infos()}["t1"]
        pieces += [d async for d in stream]
        after = await text("t1")
        upgrade.point(writer, {"t1": "t1"})
        await engine.catalog.refresh()
        return old, new, "".join(p.text for p in pieces), after, await text("t1"), switched

    old, new, in_flight, after, rolled_back, switched = asyncio.run(run())
    assert old != new  # the two bases answer differently, so the test can tell them apart
    assert in_flight == old and after == new and rolled_back == old
    assert switched == ("llama2", "t1.llama2")


def test_the_cli_upgrades_dry_runs_and_rolls_back(store, transfers, tmp_path, capsys):
    from serve.cli import main

    argv = ["store", "upgrade", "--store", str(store.root), "--from", "llama", "--to", "llama2"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 tenant adapters, 4 to transfer" in out and not transfers
    code = main([*argv, "--report", str(tmp_path / "up.json"), "--samples", "2", "--max-attempts", "48",
                 "--steps", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out.splitlines()[-1].startswith("3 of 4 names answered by 'llama2'; "), err
    assert "t2: failed: no better than the target alone" in out
    assert main([*argv, "--rollback"]) == 0
    assert capsys.readouterr().out == "3 names answered by 'llama' again: t1, t3, t4\n"
    store.reload()
    assert store.manifest.aliases == {}


def test_a_name_points_only_at_a_variant_and_an_entry_a_name_points_at_is_not_removed(store):
    from serve.errors import BadRequest

    variant_kind_add = variant_kind("pissa").add
    variant_kind_add(store, "t1.llama2", "llama2", store.variant_dir("t1"))
    with pytest.raises(BadRequest, match="no such variant"):
        upgrade.point(store, {"t1": "nope"})
    with pytest.raises(BadRequest, match="no such variant"):  # a chain written at once, as one read back refuses
        upgrade.point(store, {"t2": "t1", "t1": "t1.llama2"})
    with pytest.raises(BadRequest, match="is a base"):
        upgrade.point(store, {"llama": "t1.llama2"})
    upgrade.point(store, {"t1": "t1.llama2"})
    with pytest.raises(BadRequest, match="answers for 't1'"):
        store.remove("t1.llama2")
    upgrade.point(store, {"t1": "t1"})
    store.remove("t1.llama2")
    assert store.manifest.aliases == {} and "t1.llama2" not in store.manifest.variants
