"""The guard on every Trans-LoRA transfer: on the adapter's validation set, the student against the target base
alone and, where the shapes allow, the source adapter applied unchanged to the target. A student that is no
better than the target alone is refused, so a transfer never leaves a tenant worse off than no adapter at all.
Where the source adapter fits the target and beats the target alone, it is the incumbent: it stays (not
transferred) unless the student beats it, since a validation set of 32 examples cannot tell 0.92 from 1.00: on
spam (issue 36, seed 1) a student that led it there (1.00 against 0.97) answered 0.92 of the held-out messages
right against its 1.00. Where the completions are labels, better means a higher accuracy by more than chance on
the validation set (validation.Score.beats), else a lower loss."""

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serve.adapters.data import PromptExample
from serve.adapters.distill import same_tokens
from serve.adapters.load import load_lm, with_adapter
from serve.adapters.validation import Score, accuracy_margin, labels_of, score
from serve.errors import ArtifactError, ManyfoldError, VariantIncompatible
from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LABELS_CONFIG

MIN_GAIN = 1e-3
"""Nats per completion token a model must gain over the target alone to count as better: below it, the
difference is float noise (an untrained student is the target alone, up to rounding)."""
Outcome = Literal["student", "unchanged"]
"""What a transfer keeps: the student trained on the target, or the source adapter as it was (not transferred)."""
KEEPS_IT = "without --always-student it is kept"
"""How a refusal or a report says that the source adapter unchanged would have been kept."""


class TransferFailed(ManyfoldError):
    code = "transfer_failed"
    http_status = 422


@dataclass(frozen=True)
class Comparison:
    """Validation figures on the target base: losses (mean cross-entropy per completion token) and, where the
    completions are labels, accuracies (None otherwise, and in reports written before they were kept)."""

    student: float
    target_alone: float
    unchanged: float | None
    """The source adapter applied unchanged to the target; None where it does not fit (unfit says why)."""
    unfit: str | None
    student_accuracy: float | None = None
    target_alone_accuracy: float | None = None
    unchanged_accuracy: float | None = None
    examples: int = 0
    """How many validation examples the accuracies are over (validation.accuracy_margin)."""

    @classmethod
    def of(cls, student: Score, target_alone: Score, unchanged: Score | None, unfit: str | None) -> "Comparison":
        loss, accuracy = (None, None) if unchanged is None else (unchanged.loss, unchanged.accuracy)
        return cls(student.loss, target_alone.loss, loss, unfit, student.accuracy, target_alone.accuracy, accuracy,
                   student.examples)

    def score(self, who: str) -> Score | None:
        loss = getattr(self, who)
        return None if loss is None else Score(loss, getattr(self, f"{who}_accuracy"), self.examples)

    def unchanged_wins(self) -> bool:
        unchanged = self.score("unchanged")
        return unchanged is not None and unchanged.beats(self.score("student"), MIN_GAIN)

    def figures(self) -> str:
        def one(who: str, label: str) -> str:
            s = self.score(who)
            accuracy = "" if s.accuracy is None else f" (accuracy {s.accuracy:.2f})"
            return f"{label} {s.loss:.2f}{accuracy}"

        unchanged = "" if self.unchanged is None else f", {one('unchanged', 'source adapter unchanged')}"
        margin = ("" if self.student_accuracy is None or not self.examples else
                  f"; an accuracy counts as better when it leads by more than {accuracy_margin(self.examples):.2f} "
                  f"on {self.examples} examples")
        return f"{one('student', 'student')}, {one('target_alone', 'target alone')}{unchanged}{margin}"


def unfit_reason(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path,
                 depth: bool = True) -> str | None:
    """Why the source adapter cannot be applied unchanged to the target base (None where it can): the two
    tokenizers must number every token alike, the bases have the same depth, and each adapted module must exist
    in the target with its shape (depth False: the shapes and tokens alone, for an adapter already projected onto
    the target's layers)."""
    from serve.store.tensors import SafetensorsSource
    from serve.variants.lora import parse_adapter

    differ = same_tokens(source_base, target_base) or (other_depth(source_base, target_base) if depth else None)
    if differ is not None:
        return differ
    try:
        parse_adapter(Path(adapter_dir), SafetensorsSource(target_base).shapes(), "target", max_rank=1 << 30)
    except (VariantIncompatible, ArtifactError) as e:
        return str(e)
    return None


def other_depth(source_base: str | Path, target_base: str | Path) -> str | None:
    """Why an adapter's layers, matched by name, would not line up in the target (None where they do): a base of
    another depth numbers its layers otherwise (a layer inserted shifts every name after it), so that an adapter
    loaded by name lands on other layers even where every shape fits."""
    from transformers import AutoConfig

    depths = [getattr(AutoConfig.from_pretrained(b), "num_hidden_layers", None) for b in (source_base, target_base)]
    if depths[0] != depths[1]:
        return f"the source base has {depths[0]} layers and the target {depths[1]}: its layers do not line up"
    return None


def compare(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, student_dir: str | Path,
            held: list[PromptExample]) -> Comparison:
    """Each model's score on the real validation completions, each loaded as it would be served."""
    labels = labels_of(held)
    target, tok = load_lm(target_base)
    target_alone = score(target, tok, held, labels)
    unfit = unfit_reason(source_base, adapter_dir, target_base)
    unchanged = None
    if unfit is None:
        unchanged = score(with_adapter(target, adapter_dir).eval(), tok, held, labels)
    del target
    student, tok = load_lm(target_base, student_dir)
    return Comparison.of(score(student, tok, held, labels), target_alone, unchanged, unfit)


def choose(c: Comparison, keep_unchanged: bool) -> Outcome:
    """The adapter to keep: with keep_unchanged, the source adapter unchanged where it fits and beats the target
    alone, unless the student beats it; else the student. TransferFailed (with the figures) when the one chosen is
    no better than the target alone."""
    alone, unchanged, student = c.score("target_alone"), c.score("unchanged"), c.score("student")
    incumbent = unchanged is not None and unchanged.beats(alone, MIN_GAIN)
    outcome: Outcome = "unchanged" if keep_unchanged and incumbent and not student.beats(unchanged, MIN_GAIN) \
        else "student"
    if not c.score(outcome).beats(alone, MIN_GAIN):
        hint = f"; the source adapter unchanged does better: {KEEPS_IT}" if incumbent else ""
        raise TransferFailed(f"no better than the target alone ({c.figures()}){hint}")
    return outcome


def copy_unchanged(adapter_dir: str | Path, stage: Path) -> None:
    """Put the source adapter's own files in place of the student's in `stage`."""
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LABELS_CONFIG):
        (stage / f).unlink(missing_ok=True)
        if (Path(adapter_dir) / f).is_file():
            shutil.copy2(Path(adapter_dir) / f, stage / f)


def summary(compared: dict) -> str:
    """One line of a report's `compared` figures, saying so when the source adapter unchanged beat the student."""
    c = Comparison(**compared)
    better = f"; the source adapter unchanged does better than the student ({KEEPS_IT})" if c.unchanged_wins() else ""
    return f"validation: {c.figures()}{better}"
