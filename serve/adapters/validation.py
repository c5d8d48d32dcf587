"""Trans-LoRA's validation set: real examples kept beside an adapter that nobody trains on, a model's score on it
(the loss of their completions, and where the completions are labels its accuracy), and the early stopping of a
student on that score.

At `adapter train --discriminator` the owner's examples are split, in file order, into SEEDS seeds (shown to the
generator), a validation set (at most VALIDATION, and at most half of what is left past the seeds) and the rest;
the adapter and its discriminator train on the seeds and the rest, never on the validation set.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serve.adapters.data import IGNORE, PromptExample, TrainExample, collate, parse_example, tokenize_examples
from serve.adapters.generation_schedule import label_groups
from serve.adapters.load import on_device
from serve.errors import ArtifactError
from serve.variants.lora import TRANSLORA_DIR

VALIDATION_FILE = "validation.jsonl"
VALIDATION = 32
EVAL_EVERY = 5
"""Steps between two validations of a student (and always at its first and last step)."""
PATIENCE = 4
"""Validations without a new best before a student stops."""
FULL_SET = 64
"""Accepted examples at which a student gets the whole default lr; fewer get proportionally less."""
FRESH_LR, FITTED_LR = 5e-4, 1e-4
"""The default lr of a student that starts from a fresh adapter, and of one that starts from a fitted one (the
source adapter, or its projection onto the target's layers). At 5e-4 every student of the second kind was best at
its 5th to 20th step and its validation curve swung from there (issue 36, seed 0). At 1e-4, on the same inputs,
spam's held-out accuracy rose from 0.95 to 0.97, tweets' loss fell from 4.425 to 4.387, and headlines' stayed
level (3.019, 3.016) (bench-results/translora-36-ablation.json)."""
EPOCHS, MIN_STEPS, MAX_STEPS = 10, 20, 200


def validation_count(examples: int, seeds: int, most: int = VALIDATION) -> int:
    """How many examples to hold out: half of those past the seeds, at most `most`, at least one."""
    return max(1, min(most, (examples - seeds) // 2))


def split_examples(examples: list[TrainExample], seeds: int, most: int = VALIDATION
                   ) -> tuple[list[TrainExample], list[TrainExample], list[TrainExample]]:
    """(seeds, validation, rest) in file order; training may use the seeds and the rest, never the validation."""
    v = validation_count(len(examples), seeds, most)
    return examples[:seeds], examples[seeds:seeds + v], examples[seeds + v:]


def trained_on(examples: list[TrainExample], seeds: int, most: int = VALIDATION) -> list[TrainExample]:
    """What an adapter trained with Trans-LoRA's assets learns from: the seeds and the rest, never the validation
    set its transfers' guard reads (split_examples)."""
    kept, _, rest = split_examples(examples, seeds, most)
    return kept + rest


def write_validation(root: Path, examples: list[TrainExample]) -> None:
    (root / VALIDATION_FILE).write_text("".join(json.dumps(e.model_dump()) + "\n" for e in examples))


def read_validation(adapter_dir: str | Path) -> list[TrainExample] | None:
    """The validation examples kept beside an adapter; None for assets kept before validation sets were."""
    path = Path(adapter_dir) / TRANSLORA_DIR / VALIDATION_FILE
    if not path.is_file():
        return None
    try:
        examples = [parse_example(json.loads(line)) for line in path.read_text().splitlines() if line]
    except ValueError as e:
        raise ArtifactError(f"{path}: malformed validation examples ({str(e).splitlines()[0]})") from None
    if not examples:
        raise ArtifactError(f"{path}: no validation examples")
    return examples


@torch.no_grad()
def completion_nll(model, tok, examples: list[TrainExample], max_length: int = 128, batch: int = 8
                   ) -> tuple[list[float], list[int], list[float]]:
    """Per example: the summed cross-entropy over its completion tokens (eos included), how many there are, and
    the last one's (the eos, which tokenize_example appends)."""
    features = tokenize_examples(tok, examples, max_length)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sums: list[float] = []
    counts: list[int] = []
    ends: list[float] = []
    for i in range(0, len(features), batch):
        b = on_device(collate(features[i:i + batch], pad), model)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [rows, t, vocab]
        labels = b["labels"][:, 1:]  # [rows, t-1]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels, ignore_index=IGNORE,
                                                reduction="none")  # [rows, t-1], 0 where ignored
        scored = labels != IGNORE  # [rows, t-1]
        last = (scored * torch.arange(scored.shape[1], device=scored.device)).argmax(dim=1)  # [rows]
        sums += nll.sum(dim=1).tolist()
        counts += scored.sum(dim=1).tolist()
        ends += nll.gather(1, last[:, None])[:, 0].tolist()
    return sums, counts, ends


def completion_loss(model, tok, examples: list[TrainExample], max_length: int = 128, batch: int = 8) -> float:
    """Mean cross-entropy per completion token (eos included) over every example: lower is better, and it
    compares models of one tokenizer on the same texts."""
    sums, counts, _ = completion_nll(model, tok, examples, max_length, batch)
    return sum(sums) / max(sum(counts), 1)


@dataclass(frozen=True)
class Score:
    """A model on the validation set: its loss per completion token and, where the completions are labels, its
    accuracy over `examples`. Accuracy comes first where there is one: a student can learn a label's form (its
    loss falls from 6.6 to 0.4 nats on spam) and still answer one label to everything (accuracy 0.49, the target
    alone's 0.50)."""

    loss: float
    accuracy: float | None = None
    examples: int = 0

    def key(self) -> tuple[float, float]:
        """Larger is better: accuracy, then lower loss."""
        return (self.accuracy if self.accuracy is not None else 0.0, -self.loss)

    def beats(self, other: "Score", min_gain: float) -> bool:
        """Better by a margin that is not noise: where both have an accuracy, a higher one by more than
        accuracy_margin; else a loss lower by more than min_gain."""
        if self.accuracy is not None and other.accuracy is not None:
            return self.accuracy - other.accuracy > accuracy_margin(max(self.examples, other.examples))
        return self.loss < other.loss - min_gain


def accuracy_margin(examples: int) -> float:
    """Two standard errors of a coin's accuracy on `examples` (1 / sqrt(n); 0.18 on 32): a student picked at its
    best validation point can lead the target alone by chance. On spam a student 2 of 32 ahead on validation
    (0.56 against 0.50) answered 0.49 of the held-out messages right."""
    return 1 / math.sqrt(examples) if examples else 0.0


def labels_of(examples: list[TrainExample]) -> list[str] | None:
    """The distinct completions, where they are labels (generation_schedule.label_groups); None for free text."""
    if not examples or not all(isinstance(e, PromptExample) for e in examples):
        return None
    outputs = [e.completion for e in examples]
    return list(dict.fromkeys(outputs)) if label_groups(outputs) is not None else None


def score(model, tok, examples: list[TrainExample], labels: list[str] | None = None) -> Score:
    """The model's Score on examples. With labels (labels_of), every label is scored as each example's
    completion: the loss is the true label's, and the answer the label whose tokens are likeliest (its end of text
    left out, as lm-eval scores a choice: an untrained base's odds of stopping after a word are no answer)."""
    if labels is None:
        return Score(completion_loss(model, tok, examples))
    options = [PromptExample(prompt=e.prompt, completion=label) for e in examples for label in labels]
    sums, counts, ends = completion_nll(model, tok, options)
    n = len(labels)
    truth = [labels.index(e.completion) for e in examples]
    true = [i * n + t for i, t in enumerate(truth)]  # each example's row with its own label
    loss = sum(sums[k] for k in true) / max(sum(counts[k] for k in true), 1)
    answers = [min(range(n), key=lambda j: sums[i * n + j] - ends[i * n + j]) for i in range(len(examples))]
    return Score(loss, sum(a == t for a, t in zip(answers, truth)) / len(examples), len(examples))


def student_schedule(accepted: int, steps: int | None, lr: float | None, fitted: bool = False) -> tuple[int, float]:
    """(steps, lr) of a student trained on `accepted` examples, where not given: EPOCHS epochs of batches of 4
    (within MIN_STEPS..MAX_STEPS), and the default rate (FITTED_LR where it starts from a fitted adapter, else
    FRESH_LR) scaled by accepted / FULL_SET (at most 1): a few examples are learnt by heart at a high rate, and
    early stopping only picks the best point of the path it is given."""
    if steps is None:
        steps = min(MAX_STEPS, max(MIN_STEPS, EPOCHS * math.ceil(accepted / 4)))
    if lr is None:
        lr = (FITTED_LR if fitted else FRESH_LR) * min(1.0, accepted / FULL_SET)
    return steps, lr


@dataclass
class EarlyStopping:
    """Validate a training model at step 0, every `every` steps and at the last; keep a copy of its trainable
    weights at the best score (Score.key), and say stop after `patience` validations without a new best.
    restore() puts the best weights back, so what is saved is the best point, not the last."""

    evaluate: Callable[[object], Score]
    """Called with the model in eval mode."""
    every: int = EVAL_EVERY
    patience: int = PATIENCE
    curve: list[dict[str, float]] = field(default_factory=list)
    best_step: int = 0
    best: Score | None = None
    _weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """The trainable weights at the best point."""

    def check(self, model, step: int, last: bool = False) -> bool:
        """Validate if this step is due; True when training should stop."""
        if step % self.every and not last:
            return False
        was_training = model.training
        model.eval()
        now = self.evaluate(model)
        model.train(was_training)
        self.curve.append({"step": step, "loss": now.loss}
                          | ({} if now.accuracy is None else {"accuracy": now.accuracy}))
        if self.best is None or now.key() > self.best.key():
            self.best_step, self.best = step, now
            self._weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return step - self.best_step >= self.every * self.patience

    @torch.no_grad()
    def restore(self, model) -> None:
        for n, p in model.named_parameters():
            if n in self._weights:
                p.copy_(self._weights[n])
