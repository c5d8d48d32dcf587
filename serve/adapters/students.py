"""A Trans-LoRA transfer's students: which synthetic inputs a student learns from is measured per target, not
fixed. The discriminator's filter helped spam and hurt headlines (bench-results, Trans-LoRA: 0.92 against 0.75
without it on spam; on headlines it kept 6 of 192 inputs, and the student of the unfiltered ones did better), so
where it refused at least MIN_REFUSED of the first inputs written, a second student (the same start, schedule
rule, teacher and validation) learns from those inputs as written, and the one with the better validation score
is kept. The filter's set is the incumbent (the paper's method): replaced only where the other's student beats
it as the guard counts better (validation.Score.beats)."""

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serve.adapters.data import PromptExample, TrainExample
from serve.adapters.distill import Teacher
from serve.adapters.generation_schedule import Sampling
from serve.adapters.train import TrainResult, train_adapter
from serve.adapters.transfer_guard import MIN_GAIN
from serve.adapters.validation import EarlyStopping, Score, labels_of, score, student_schedule

KEPT, WRITTEN = "kept by the discriminator", "as written"
"""The input sets a student may learn from: those the discriminator kept, and as many of the first ones the
target wrote, whatever it said of them (every fresh one without the filter)."""
MIN_REFUSED = 0.25
"""The share of the inputs as written that the discriminator refused, at least, for a second student to be worth
its minutes: below it the two sets are nearly one."""
Tick = Callable[[str, int, int], None]
"""Progress, called as (phase, done, total) (translora.Progress)."""


def input_sets(sampling: Sampling, filtered: bool, measure: bool) -> dict[str, list[str]]:
    """{set: its inputs}, a student each: without the filter, the inputs as written; with it, those it kept and,
    with measure, the inputs as written where it refused at least MIN_REFUSED of them."""
    if not filtered:
        return {WRITTEN: sampling.accepted}
    sets = {KEPT: sampling.accepted}
    written, kept = sampling.as_written(), set(sampling.accepted)
    if measure and written and sum(x not in kept for x in written) >= MIN_REFUSED * len(written):
        sets[WRITTEN] = written
    return sets


def choose_inputs(best: dict[str, Score | None]) -> tuple[str, str]:
    """(the set whose student is kept, why), from each student's best validation score: the only one, else the
    filter's unless the student of the inputs as written beats it (Score.beats)."""
    if len(best) == 1:
        only = next(iter(best))
        return only, ("no filter" if only == WRITTEN else
                      f"one set: the filter refused under {MIN_REFUSED:.0%} of the inputs written, or the measure "
                      f"was off (--filtered-only, or no early stopping to measure by)")
    kept, written = best[KEPT], best[WRITTEN]
    figures = f"validation: {KEPT} {_figure(kept)}, {WRITTEN} {_figure(written)}"
    if written is not None and (kept is None or written.beats(kept, MIN_GAIN)):
        return WRITTEN, f"the inputs {WRITTEN} taught a better student ({figures})"
    return KEPT, f"the inputs {WRITTEN} taught no better student ({figures})"


def _figure(s: Score | None) -> str:
    if s is None:
        return "not validated"
    return f"{s.loss:.3f}" + ("" if s.accuracy is None else f" (accuracy {s.accuracy:.2f})")


@dataclass(frozen=True)
class Trainer:
    """How every student of one transfer trains: the same start, schedule rule, teacher, validation and budget."""

    target_base: Path | str
    init: str
    rank: int
    start: Path | None
    """The adapter every student starts from (student_start.py), or None for a fresh `init`."""
    steps: int | None
    lr: float | None
    """None: validation.student_schedule's, for the student's examples."""
    seed: int
    early_stop: bool
    teacher: Teacher | None
    """Whose next-token distributions the students learn beside the completions (distill.py), or None."""
    held: list[PromptExample]
    out_of_time: Callable[[], bool]
    tick: Tick


@dataclass
class Student:
    out: Path
    result: TrainResult
    early: EarlyStopping
    steps: int
    lr: float
    inputs: int
    examples: int
    """Its inputs the teacher answered (a blank answer is no example)."""

    def validation(self) -> dict:
        """The report's validation figures of this student: its best step and the curve of its validations."""
        return {"best_step": self.early.best_step, "curve": self.early.curve}

    def summary(self) -> dict:
        """The report's figures of one set's student (TransferReport.inputs)."""
        best = self.early.best
        return {"inputs": self.inputs, "examples": self.examples, "steps": self.steps, "lr": self.lr,
                "best_step": self.early.best_step, "loss": None if best is None else best.loss,
                "accuracy": None if best is None else best.accuracy}


def train_students(t: Trainer, sets: dict[str, list[str]], taught: dict[str, TrainExample], stage: Path
                   ) -> tuple[Student, dict]:
    """A student per set (input_sets) on the teacher's examples of its inputs, trained in stage's subfolders; the
    chosen one's files moved into stage and the folders removed. (the chosen student, the report's `inputs`:
    chosen, why, and each set's figures)."""
    students, evaluate = {}, _validation_score(t.target_base, t.held)
    for i, (name, inputs) in enumerate(sets.items()):
        phase = "student training" + ("" if len(sets) == 1 else f" ({name})")
        students[name] = _student(t, inputs, taught, EarlyStopping(evaluate), stage / f".student-{i}", phase)
    chosen, why = choose_inputs({name: s.early.best for name, s in students.items()})
    for f in students[chosen].out.iterdir():
        os.replace(f, stage / f.name)
    for s in students.values():
        shutil.rmtree(s.out)
    return students[chosen], {"chosen": chosen, "why": why,
                              "sets": {name: s.summary() for name, s in students.items()}}


def _student(t: Trainer, inputs: list[str], taught: dict[str, TrainExample], early: EarlyStopping, out: Path,
             phase: str) -> Student:
    """One student trained on the teacher's examples of `inputs` into out, validated by `early` (and stopped early
    where t.early_stop)."""
    data = [taught[x] for x in inputs if x in taught]
    steps, lr = student_schedule(len(data), t.steps, t.lr, fitted=t.start is not None)
    result = train_adapter(t.target_base, data, out, init=t.init, rank=t.rank, steps=steps, lr=lr, seed=t.seed,
                           progress=lambda step, loss: t.tick(phase, step, steps),
                           early_stopping=early if t.early_stop else None, start_from=t.start,
                           loss_of=None if t.teacher is None else t.teacher.loss, out_of_time=t.out_of_time)
    return Student(out, result, early, steps, lr, len(inputs), len(data))


def _validation_score(target_base: str | Path, held: list[PromptExample]) -> Callable[[object], Score]:
    """A student's score on the target base's tokens of the real validation completions (its accuracy first where
    they are labels): what every student of the transfer is validated by (one tokenizer load for all)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_base)
    labels = labels_of(held)
    return lambda model: score(model, tok, held, labels)
