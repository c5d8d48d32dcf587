"""The load-test variant plans: names, the mix of kinds, the task each name maps to (no training, no Ray)."""

import pytest

from loadtests.variants import SCENARIOS, TASKS, mix, mix_text, variant_names, variant_plan, variant_task


def test_older_scenarios_keep_their_names_and_are_all_full():
    for scenario in ("full", "top2"):
        plan = variant_plan(20, scenario)
        assert [v.name for v in plan[:4]] == ["lt-topic-00", "lt-sentiment-01", "lt-spam-02", "lt-topic-03"]
        assert mix(plan) == {"full": 20, "lora": 0}
    assert variant_names(3) == ["lt-topic-00", "lt-sentiment-01", "lt-spam-02"]


def test_mixed_is_three_quarters_adapters_and_names_say_the_kind():
    n = SCENARIOS["mixed"].variants
    assert n >= 50
    plan = variant_plan(n, "mixed")
    assert mix(plan) == {"lora": 39, "full": 13}
    assert [v.name for v in plan[:5]] == ["lt-lora-topic-00", "lt-lora-sentiment-01", "lt-lora-spam-02",
                                          "lt-full-topic-03", "lt-lora-sentiment-04"]
    assert all(v.name.startswith(f"lt-{v.kind}-{v.task}-") for v in plan)
    assert len({v.name for v in plan}) == n and len({v.seed for v in plan}) == n
    for kind in ("lora", "full"):  # every task gets both kinds
        assert {v.task for v in plan if v.kind == kind} == set(TASKS)
    assert variant_names(n, "mixed") == [v.name for v in plan]


def test_mixed_defaults_differ_from_the_others():
    assert SCENARIOS["mixed"].rate_rps > SCENARIOS["full"].rate_rps == SCENARIOS["top2"].rate_rps
    assert SCENARIOS["full"].variants == SCENARIOS["top2"].variants == 20
    assert SCENARIOS["mixed"].top_layers == 2
    assert SCENARIOS["mixed"].max_chars < SCENARIOS["full"].max_chars == SCENARIOS["top2"].max_chars == 2000


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_name_maps_back_to_its_task(scenario):
    for v in variant_plan(60, scenario):
        assert variant_task(v.name) == v.task


def test_a_name_without_a_task_is_refused():
    with pytest.raises(ValueError, match="no load-test task"):
        variant_task("lt-lora-07")


def test_mix_text():
    assert mix_text({"lora": 39, "full": 13}, short=True) == "39 LoRA + 13 full"
    assert mix_text({"lora": 0, "full": 20}) == "20 full fine-tunes (every weight)"
    line = mix_text({"lora": 39, "full": 13}, 2)
    assert line.startswith("39 LoRA adapters (rank 8 on query, value") and line.endswith(
        "+ 13 full fine-tunes (top 2 layers + head)")
