"""The prefix scenario's arrival plan and report math on synthetic records; no server, no timing."""

import argparse

from loadtests.fairness import TENANTS
from loadtests.fairness_load import Caller
from loadtests.fairness_report import Record
from loadtests.prefix import plan, summary


def test_every_tenant_sends_a_first_and_later_requests_behind_its_own_system_prompt():
    callers = [Caller(t, f"sk-{t}", f"{t}-lora") for t in TENANTS]
    system = {t: f"system of {t}." for t in TENANTS}
    args = argparse.Namespace(requests=3, duration=30.0, seed=0)
    planned = plan(callers, system, ["turn one", "turn two"], args)
    assert [p.at_s for p in planned] == sorted(p.at_s for p in planned)
    for t in TENANTS:
        mine = [p for p in planned if p.caller.tenant == t]
        assert len(mine) >= 2 and all(p.prompt.startswith(system[t] + "\n\n") for p in mine)
    assert plan(callers, system, ["turn one", "turn two"], args) == planned  # seeded


def test_the_summary_sets_each_tenants_first_answer_against_its_later_ones():
    records = []
    for k, t in enumerate(TENANTS):
        records += [Record(t, 1.0 + k, "200", 4.0, 2, [5.0 + k], cached_tokens=0),
                    Record(t, 10.0 + k, "200", 0.5, 2, [10.5 + k], cached_tokens=1024),
                    Record(t, 20.0 + k, "429"), Record(t, 25.0 + k, "200", None, 2)]  # an answer with no text
    s = summary(records, 30.0)
    assert (s["ok"], s["not_ok"]) == (24, 8)
    assert s["ttft_first_p50_s"] == 4.0 and s["ttft_later_p50_s"] == 0.5 and s["first_over_later_p50"] == 8.0
    assert s["cached_tokens"] == 8 * 1024 and s["tokens_per_s"] == 48 / 30.0
