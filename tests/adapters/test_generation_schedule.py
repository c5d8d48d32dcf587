"""The schedule of a transfer's synthetic inputs without a model: a writer of distinct candidates and a filter that
passes a fixed share of what it is shown (as the transfer tests stub Discriminator.accepts)."""

import itertools
import random

import pytest

from serve.adapters import generation_schedule as gs
from serve.errors import ConfigError


def distinct_writer(log: list[tuple[int, float, int]] | None = None) -> gs.Write:
    """Writes candidates never seen before, noting each call's (count, temperature, seed)."""
    counter = itertools.count()

    def write(n: int, temperature: float, seed: int) -> list[str]:
        if log is not None:
            log.append((n, temperature, seed))
        return [f"input {next(counter)}" for _ in range(n)]

    return write


def passing_one_in(every: int) -> gs.Judge:
    """A filter that passes the 1st, (every+1)th, ... candidate it is shown: a rate of exactly 1 / every."""
    shown = itertools.count()
    return lambda xs: [next(shown) % every == 0 for _ in xs]


@pytest.mark.parametrize("every", [2, 8])
def test_attempts_scale_with_the_acceptance_rate_measured_on_the_first_round(every):
    plan = gs.AttemptPlan.build(samples=16, max_attempts=1000)
    out = gs.sample_inputs(distinct_writer(), passing_one_in(every), plan, set(), seed=0)
    assert len(out.accepted) == 16 and out.attempts == 16 * every  # no more written than the rate needs
    first_round_passed = gs.FIRST_ROUND // every
    assert out.planned_attempts == gs.FIRST_ROUND + (16 - first_round_passed) * every
    assert out.summary()["acceptance_rate"] == pytest.approx(1 / every)
    assert sum(b.attempts for b in out.batches) == out.attempts


def test_a_batch_after_the_first_round_is_sized_to_what_is_still_needed():
    b = gs.BATCH
    plan = gs.AttemptPlan.build(samples=3 * b // 2 + 2, max_attempts=1000)
    log = []
    out = gs.sample_inputs(distinct_writer(log), passing_one_in(2), plan, set(), seed=5)
    assert [n for n, _, _ in log] == [b, b, b, 4]  # 3b/2 passed in the first round; 2 more need 4 at 1 in 2
    assert [s for _, _, s in log] == [5, 5 + b, 5 + 2 * b, 5 + 3 * b] and out.count("surplus") == 0


def test_batches_take_the_temperatures_in_turn():
    plan = gs.AttemptPlan.build(samples=gs.BATCH, max_attempts=8 * gs.BATCH)
    log = []
    out = gs.sample_inputs(distinct_writer(log), passing_one_in(4), plan, set(), seed=0)
    assert [t for _, t, _ in log][:4] == [0.7, 1.0, 1.3, 0.7]
    assert out.summary()["temperatures"] == [0.7, 1.0, 1.3]
    assert [b["temperature"] for b in out.summary()["batches"]] == [t for _, t, _ in log]


def test_the_loop_ends_at_the_cap_whatever_the_writer_does():
    for write in (lambda n, t, s: [""] * n, lambda n, t, s: ["the same"] * n, distinct_writer()):
        plan = gs.AttemptPlan.build(samples=4, max_attempts=20)
        out = gs.sample_inputs(write, lambda xs: [False] * len(xs), plan, set(), seed=0)
        assert out.attempts == 20 and not out.accepted
        assert out.count("rejected") + out.count("dropped") == 20


def test_a_hopeless_run_stops_long_before_the_cap_with_the_figures():
    plan = gs.AttemptPlan.build(samples=48)  # the cap: 768
    out = gs.sample_inputs(distinct_writer(), lambda xs: [False] * len(xs), plan, set(), seed=0)
    assert gs.FIRST_ROUND < out.attempts <= 768 // 4 and not out.accepted  # 3 / attempts x the rest < 12
    assert out.shortfall() == (
        f"only 0 of {out.attempts} generated inputs accepted (0.0%), short of the 12 a student needs "
        f"(--min-accepted), and at that rate the other {768 - out.attempts} of --max-attempts 768 would not "
        f"reach it: add seed examples (adapter train --discriminator --seeds), raise --max-attempts or lower "
        f"--min-accepted")


def test_a_slow_filter_goes_on_past_the_first_round_and_reaches_the_floor():
    plan = gs.AttemptPlan.build(samples=48, max_attempts=768)  # the headlines case: about 1 in 30 passes
    out = gs.sample_inputs(distinct_writer(), passing_one_in(30), plan, set(), seed=0)
    assert out.attempts == 768 and plan.floor == 12 <= len(out.accepted) < 48


def test_fresh_candidates_only_reach_the_filter():
    shown = []

    def judge(xs):
        shown.extend(xs)
        return [True] * len(xs)

    plan = gs.AttemptPlan.build(samples=3, max_attempts=8)
    out = gs.sample_inputs(lambda n, t, s: ["a seed", "", "new", "new"] * (n // 4), judge, plan, {"a seed"}, seed=0)
    assert shown == ["new"] and out.accepted == ["new"] and out.count("dropped") == 7


def test_defaults_and_bad_plans():
    assert gs.AttemptPlan.build(64) == gs.AttemptPlan(samples=64, floor=16, cap=1024)
    assert gs.AttemptPlan.build(2).floor == 1
    with pytest.raises(ConfigError, match=r"^samples must be >= 1; got 0$"):
        gs.AttemptPlan.build(0)
    with pytest.raises(ConfigError, match=r"^min_accepted must be between 1 and samples \(8\); got 9$"):
        gs.AttemptPlan.build(8, min_accepted=9)
    with pytest.raises(ConfigError, match=r"^max_attempts \(3\) must be >= min_accepted \(4\)$"):
        gs.AttemptPlan.build(16, max_attempts=3)


def test_each_prompt_shows_a_seeded_subset_of_the_seeds_in_its_own_order():
    parts = [f"seed {i}" for i in range(5)]
    shown = [gs.shown_seeds(parts, random.Random(7)) for _ in range(2)]
    assert shown[0] == shown[1]  # the same seed shows the same
    rng = random.Random(0)
    many = [gs.shown_seeds(parts, rng) for _ in range(20)]
    assert all(3 <= len(s) <= 5 and len(set(s)) == len(s) and set(s) <= set(parts) for s in many)
    assert len({tuple(s) for s in many}) > 10
    assert gs.shown_seeds(["only"], rng) == ["only"]


def test_a_sampling_read_back_from_json_is_the_one_written():
    import json

    plan = gs.AttemptPlan.build(samples=gs.BATCH, max_attempts=8 * gs.BATCH)
    out = gs.sample_inputs(distinct_writer(), passing_one_in(4), plan, set(), seed=0)
    back = gs.Sampling.from_dict(json.loads(json.dumps(out.to_dict())))
    assert back == out and back.summary() == out.summary()


def test_labels_are_told_from_free_text_and_a_labels_prompt_shows_its_seeds_only():
    assert gs.label_groups([" yes", " no", " yes", " no", " yes"]) == [[0, 2, 4], [1, 3]]
    assert gs.label_groups([" positive", " negative", " neutral", " positive", " negative", " neutral"]) == \
        [[0, 3], [1, 4], [2, 5]]
    assert gs.label_groups([" Bank raises rates", " Storm hits coast", " Team wins cup", " yes", " no"]) is None
    assert gs.label_groups([" a", " b", " c", " a", " d"]) is None  # four values among five seeds: not labels
    assert gs.label_groups([" the rest of a long tweet about the weather"] * 4) is None
    parts = [f"seed {i}" for i in range(5)]
    for s in range(20):
        assert set(gs.shown_seeds(parts, random.Random(s), [1, 3])) <= {"seed 1", "seed 3"}
