"""Trans-LoRA's validation set, a model's score on it, and early stopping: what is held out, what counts as
better, and which weights a student keeps."""

import pytest
import torch

from serve.adapters.data import PromptExample, TextExample
from serve.adapters.load import load_lm
from serve.adapters.transfer_guard import Comparison, TransferFailed, choose
from serve.adapters.validation import (EarlyStopping, Score, accuracy_margin, completion_loss, labels_of, score,
                                       split_examples, student_schedule, trained_on)
from tests.models import write_tiny_causal


def test_the_validation_set_is_held_out_between_the_seeds_and_the_rest():
    examples = [TextExample(text=f"text {i}") for i in range(60)]
    seeds, held, rest = split_examples(examples, 5)
    assert (len(seeds), len(held), len(rest)) == (5, 27, 28) and seeds + held + rest == examples
    assert [len(part) for part in split_examples(examples[:7], 5)] == [5, 1, 1]  # little data: one held out
    assert len(split_examples(examples * 2, 5)[1]) == 32  # at most 32
    assert trained_on(examples, 5) == seeds + rest and not set(e.text for e in held) & {
        e.text for e in trained_on(examples, 5)}  # what an adapter with Trans-LoRA's assets learns from


def test_early_stopping_stops_after_its_patience_and_restores_the_best_weights():
    model = torch.nn.Linear(2, 2)
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7, 2.8])
    early = EarlyStopping(lambda m: Score(next(losses)), every=5, patience=4)
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


def test_a_student_that_starts_from_a_fitted_adapter_gets_the_lower_rate_scaled_alike():
    assert student_schedule(64, None, None, fitted=True) == (160, 1e-4)
    assert student_schedule(32, None, None, fitted=True) == (80, 1e-4 / 2)
    assert student_schedule(64, None, 3e-4, fitted=True) == (160, 3e-4)  # as given


def test_where_the_completions_are_labels_accuracy_orders_first_then_loss():
    scores = iter([Score(6.6, 0.50), Score(0.4, 0.50), Score(0.9, 0.75), Score(0.5, 0.75), Score(0.3, 0.70)])
    early = EarlyStopping(lambda m: next(scores), every=1, patience=10)
    for step in range(5):
        early.check(torch.nn.Linear(1, 1), step)
    assert early.best_step == 3 and early.best == Score(0.5, 0.75)
    assert early.curve[1] == {"step": 1, "loss": 0.4, "accuracy": 0.5}


def test_a_student_that_learnt_the_labels_form_but_not_the_task_is_refused():
    """Spam, seed 2, on the new-version target: the student's loss fell from 6.63 to 0.42 nats, and it answered
    " no" to nearly everything: judged on loss it was registered at held-out accuracy 0.49; judged on validation
    accuracy it led the target alone by 2 of 32 at its best point (0.56 against 0.50), and answered 0.49 of the
    held-out messages right."""
    for student_accuracy in (0.50, 0.5625):
        c = Comparison(student=0.42, target_alone=6.63, unchanged=0.10, unfit=None, student_accuracy=student_accuracy,
                       target_alone_accuracy=0.50, unchanged_accuracy=0.97, examples=32)
        refused = (r"^no better than the target alone \(student 0\.42 \(accuracy 0\.5\d\), target alone 6\.63 "
                   r"\(accuracy 0\.50\), source adapter unchanged 0\.10 \(accuracy 0\.97\); an accuracy counts as "
                   r"better when it leads by more than 0\.18 on 32 examples\); the source adapter unchanged")
        with pytest.raises(TransferFailed, match=refused):
            choose(c, keep_unchanged=False)
        assert choose(c, keep_unchanged=True) == "unchanged"
    assert choose(Comparison(0.08, 6.63, None, "shapes", 0.91, 0.50, examples=32), keep_unchanged=True) == "student"
    assert choose(Comparison(3.5, 5.7, None, "shapes"), keep_unchanged=False) == "student"  # free text: loss
    with pytest.raises(TransferFailed):
        choose(Comparison(5.7, 5.7, None, "shapes"), keep_unchanged=False)
    assert accuracy_margin(32) == pytest.approx(0.177, abs=1e-3) and accuracy_margin(100) == 0.1


def test_the_source_adapter_stays_unless_the_student_beats_it():
    """Spam, seed 1, on the new version: the student led the source adapter unchanged on validation (1.00 against
    0.97, 1 of 32) and answered 0.92 of the held-out messages right against its 1.00."""
    c = Comparison(student=0.011, target_alone=6.63, unchanged=0.057, unfit=None, student_accuracy=1.0,
                   target_alone_accuracy=0.50, unchanged_accuracy=0.97, examples=32)
    assert choose(c, keep_unchanged=True) == "unchanged" and choose(c, keep_unchanged=False) == "student"
    ahead = Comparison(3.0, 5.7, 3.2, None)  # free text: ahead of it by more than MIN_GAIN nats
    assert choose(ahead, keep_unchanged=True) == "student"
    useless = Comparison(0.3, 6.63, 6.0, None, 0.75, 0.50, 0.55, examples=32)  # it does not beat the target alone
    assert choose(useless, keep_unchanged=True) == "student"


def test_labels_are_told_from_free_text():
    spam = [PromptExample(prompt=f"m{i}", completion=" yes" if i % 3 else " no") for i in range(8)]
    assert labels_of(spam) == [" no", " yes"]
    assert labels_of([PromptExample(prompt=f"a{i}", completion=f" headline {i}") for i in range(8)]) is None
    assert labels_of([TextExample(text="a tweet")]) is None and labels_of([]) is None


def test_a_label_score_is_each_examples_likeliest_label_and_the_true_labels_loss(tmp_path):
    """Checked against scoring every (example, label) pair one at a time, the label's tokens without the eos."""
    model, tok = load_lm(write_tiny_causal(tmp_path / "llama"))
    labels = [" yes", " no", " good day"]
    held = [PromptExample(prompt=f"the {w} sat on {w}", completion=labels[i % 3])
            for i, w in enumerate("cat dog mat tree fish bird sun moon book pen".split())]
    got = score(model, tok, held, labels)

    def label_nll(prompt: str, label: str) -> float:
        full = completion_loss(model, tok, [PromptExample(prompt=prompt, completion=label)])
        end = len(tok(label, add_special_tokens=False)["input_ids"]) + 1  # the label's tokens and the eos
        with torch.no_grad():
            ids = tok(prompt + label, return_tensors="pt")["input_ids"]
            eos = torch.tensor([[tok.eos_token_id]])
            logits = model(input_ids=torch.cat([ids, eos], dim=1)).logits[0, -2]
        return full * end - float(-torch.log_softmax(logits, -1)[tok.eos_token_id])

    answers = [min(labels, key=lambda label: label_nll(e.prompt, label)) for e in held]
    assert got.accuracy == sum(a == e.completion for a, e in zip(answers, held)) / len(held)
    assert got.loss == pytest.approx(completion_loss(model, tok, held), rel=1e-5)
    assert score(model, tok, held) == Score(completion_loss(model, tok, held))
