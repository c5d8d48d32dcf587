"""Trans-LoRA's validation set and early stopping: what is held out, and which weights a student keeps."""

import torch

from serve.adapters.data import TextExample
from serve.adapters.validation import EarlyStopping, split_examples, student_schedule


def test_the_validation_set_is_held_out_between_the_seeds_and_the_rest():
    examples = [TextExample(text=f"text {i}") for i in range(60)]
    seeds, held, rest = split_examples(examples, 5)
    assert (len(seeds), len(held), len(rest)) == (5, 27, 28) and seeds + held + rest == examples
    assert [len(part) for part in split_examples(examples[:7], 5)] == [5, 1, 1]  # little data: one held out
    assert len(split_examples(examples * 2, 5)[1]) == 32  # at most 32


def test_early_stopping_stops_after_its_patience_and_restores_the_best_weights():
    model = torch.nn.Linear(2, 2)
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7, 2.8])
    early = EarlyStopping(lambda m: next(losses), every=5, patience=4)
    stopped_at = None
    for step in range(0, 100):
        with torch.no_grad():
            model.weight.fill_(step)
        if early.check(model, step):
            stopped_at = step
            break
    assert stopped_at == 25 and early.best_step == 5
    assert [p["step"] for p in early.curve] == [0, 5, 10, 15, 20, 25]
    early.restore(model)
    assert torch.equal(model.weight, torch.full((2, 2), 5.0))


def test_a_student_schedule_scales_with_what_was_accepted_unless_given():
    assert student_schedule(6, None, None) == (20, 5e-4 * 6 / 64)
    assert student_schedule(64, None, None) == (160, 5e-4)
    assert student_schedule(500, None, None) == (200, 5e-4)
    assert student_schedule(6, 7, 1e-3) == (7, 1e-3)
