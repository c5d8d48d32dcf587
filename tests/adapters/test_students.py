"""Which synthetic inputs a transfer's student learns from: the sets measured (students.input_sets), the rule
that picks one (choose_inputs), and a transfer on tiny models that trains a student per set and writes the one
chosen."""

import json

import pytest

from serve.adapters import generation_schedule as gs
from serve.adapters import translora
from serve.adapters.students import KEPT, MIN_REFUSED, WRITTEN, choose_inputs, input_sets
from serve.adapters.validation import Score
from serve.cli import build_parser
from serve.cli.adapters import transfer_options
from tests.adapters.test_generation_schedule import distinct_writer, passing_one_in


def sampled(every: int, samples: int = 8) -> gs.Sampling:
    """Inputs "input 0", "input 1", ... written in order, the filter passing one in `every`."""
    return gs.sample_inputs(distinct_writer(), passing_one_in(every), gs.AttemptPlan.build(samples, 1000), set(), 0)


def test_a_filter_that_refuses_half_measures_the_inputs_as_written_in_the_order_written():
    s = sampled(2)
    sets = input_sets(s, filtered=True, measure=True)
    assert sets[KEPT] == [f"input {i}" for i in range(0, 16, 2)]  # the filter passes every other one
    assert sets[WRITTEN] == [f"input {i}" for i in range(8)]  # as many as wanted, whatever it said
    assert gs.Sampling.from_dict(json.loads(json.dumps(s.to_dict()))).as_written() == sets[WRITTEN]


def test_one_set_where_the_filter_refused_few_was_not_run_or_measuring_is_off():
    few = sampled(1)  # it refused none: the two sets are one
    assert 0 < MIN_REFUSED and list(input_sets(few, True, True)) == [KEPT]
    assert list(input_sets(sampled(2), True, measure=False)) == [KEPT]
    assert input_sets(few, filtered=False, measure=True) == {WRITTEN: few.accepted}


@pytest.mark.parametrize("kept, written, chosen", [
    (Score(3.0), Score(2.5), WRITTEN),
    (Score(3.0), Score(3.0), KEPT),  # a tie keeps the filter's: the incumbent
    (Score(2.5), Score(3.0), KEPT),
    (Score(0.3, 0.80, 32), Score(0.2, 0.90, 32), KEPT),  # 0.10 is within chance on 32 examples
    (Score(0.3, 0.60, 32), Score(0.2, 0.90, 32), WRITTEN),
    (None, Score(3.0), WRITTEN),  # the filter's student never validated (no early stopping)
])
def test_the_inputs_as_written_replace_the_filters_only_where_their_student_beats_its(kept, written, chosen):
    which, why = choose_inputs({KEPT: kept, WRITTEN: written})
    assert which == chosen and KEPT in why and WRITTEN in why


def test_a_transfer_trains_a_student_per_set_and_writes_the_one_chosen(bases, source_adapter, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")  # the guard: elsewhere
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [i % 2 == 0 for i in range(len(xs))])
    ticks = []
    report = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=10, progress=lambda *a: ticks.append(a[0]))
    sets = report.inputs["sets"]
    assert set(sets) == {KEPT, WRITTEN} and all(s["inputs"] == 4 and s["loss"] is not None for s in sets.values())
    assert {"student training (kept by the discriminator)", "student training (as written)"} <= set(ticks)
    best = {name: Score(s["loss"], s["accuracy"], report.validation["examples"]) for name, s in sets.items()}
    assert report.inputs["chosen"] == choose_inputs(best)[0]
    chosen = sets[report.inputs["chosen"]]
    log = json.loads((tmp_path / "moved" / "train_log.json").read_text())
    assert log["examples"] == chosen["examples"] and log["validation"]["best_step"] == chosen["best_step"]
    assert report.validation["best_step"] == chosen["best_step"] and report.steps == chosen["steps"]
    assert not list((tmp_path / "moved").glob(".student-*"))  # only the chosen student's files are left

    one = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "one", samples=4, max_attempts=48,
                             steps=2, measure_inputs=False)
    assert list(one.inputs["sets"]) == [KEPT] and one.inputs["chosen"] == KEPT


@pytest.mark.parametrize("command", [
    ["translora", "--source-base", "a", "--adapter", "b", "--target-base", "c", "--out", "d"],
    ["store", "upgrade", "--store", "s", "--from", "a", "--to", "b"],
])
def test_filtered_only_trains_one_student_on_the_filters_inputs(command):
    parser = build_parser()
    assert transfer_options(parser.parse_args(command))["measure_inputs"] is True
    assert transfer_options(parser.parse_args(command + ["--filtered-only"]))["measure_inputs"] is False
