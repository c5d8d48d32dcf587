"""The guard on every Trans-LoRA transfer: on the adapter's validation set, the student against the target base
alone and, where the shapes allow, the source adapter applied unchanged to the target; a student that is no
better than the target alone is refused, so a transfer never leaves a tenant worse off than no adapter at all."""

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serve.adapters.data import PromptExample
from serve.adapters.load import load_lm
from serve.adapters.validation import completion_loss
from serve.errors import ArtifactError, ManyfoldError, VariantIncompatible
from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LABELS_CONFIG

MIN_GAIN = 1e-3
"""Nats per completion token a model must gain over the target alone to count as better: below it, the
difference is float noise (an untrained student is the target alone, up to rounding)."""
Outcome = Literal["student", "unchanged"]
"""What a transfer keeps: the student trained on the target, or the source adapter as it was (not transferred)."""


class TransferFailed(ManyfoldError):
    code = "transfer_failed"
    http_status = 422


@dataclass(frozen=True)
class Comparison:
    """Validation losses (mean cross-entropy per completion token) on the target base."""

    student: float
    target_alone: float
    unchanged: float | None
    """The source adapter applied unchanged to the target; None where it does not fit (unfit says why)."""
    unfit: str | None

    def unchanged_wins(self) -> bool:
        return self.unchanged is not None and self.unchanged < self.student - MIN_GAIN

    def figures(self) -> str:
        unchanged = "" if self.unchanged is None else f", source adapter unchanged {self.unchanged:.2f}"
        return f"student {self.student:.2f}, target alone {self.target_alone:.2f}{unchanged}"


def unfit_reason(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path) -> str | None:
    """Why the source adapter cannot be applied unchanged to the target base (None where it can): the two
    tokenizers must number every token alike, and each adapted module must exist in the target with its shape."""
    from transformers import AutoTokenizer

    from serve.store.tensors import SafetensorsSource
    from serve.variants.lora import parse_adapter

    if AutoTokenizer.from_pretrained(source_base).get_vocab() != AutoTokenizer.from_pretrained(target_base).get_vocab():
        return "the two bases' tokenizers differ"
    try:
        parse_adapter(Path(adapter_dir), SafetensorsSource(target_base).shapes(), "target", max_rank=1 << 30)
    except (VariantIncompatible, ArtifactError) as e:
        return str(e)
    return None


def compare(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, student_dir: str | Path,
            held: list[PromptExample]) -> Comparison:
    """Each model's loss on the real validation completions, each loaded as it would be served."""
    target, tok = load_lm(target_base)
    target_alone = completion_loss(target, tok, held)
    unfit = unfit_reason(source_base, adapter_dir, target_base)
    unchanged = None
    if unfit is None:
        from peft import PeftModel

        unchanged = completion_loss(PeftModel.from_pretrained(target, adapter_dir).eval(), tok, held)
    del target
    student, tok = load_lm(target_base, student_dir)
    return Comparison(completion_loss(student, tok, held), target_alone, unchanged, unfit)


def choose(c: Comparison, keep_unchanged: bool) -> Outcome:
    """The adapter to keep: the student, or with keep_unchanged the source adapter unchanged where it does better;
    TransferFailed (with the figures) when the one chosen is no better than the target alone."""
    outcome: Outcome = "unchanged" if keep_unchanged and c.unchanged_wins() else "student"
    loss = c.unchanged if outcome == "unchanged" else c.student
    if loss is None or loss >= c.target_alone - MIN_GAIN:
        hint = ("; the source adapter unchanged does better: --keep-unchanged-if-better keeps it"
                if c.unchanged is not None and c.unchanged < c.target_alone - MIN_GAIN else "")
        raise TransferFailed(f"no better than the target alone ({c.figures()}){hint}")
    return outcome


def keep_unchanged(adapter_dir: str | Path, stage: Path) -> None:
    """Put the source adapter's own files in place of the student's in `stage`."""
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LABELS_CONFIG):
        (stage / f).unlink(missing_ok=True)
        if (Path(adapter_dir) / f).is_file():
            shutil.copy2(Path(adapter_dir) / f, stage / f)


def summary(compared: dict) -> str:
    """One line of a report's `compared` figures, saying so when the source adapter unchanged beat the student."""
    c = Comparison(**compared)
    better = ("; the source adapter unchanged does better than the student (--keep-unchanged-if-better keeps it)"
              if c.unchanged_wins() else "")
    return f"validation loss: {c.figures()}{better}"
