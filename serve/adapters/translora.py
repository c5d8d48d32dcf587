"""Trans-LoRA (METHODS.md section 5): move a task adapter to a new base with synthetic data, none of the task's.

While the task data exists (`adapter train --discriminator`), SEEDS examples and a validation set (validation.py)
are kept beside the adapter and a
discriminator is trained: a LoRA on the source base that answers " yes" to the task's real inputs and " no" to
inputs the source base wrote when shown the seeds. To transfer (`manyfold translora`), the target base writes
candidate inputs from the seeds, the discriminator keeps those it takes for real (generation_schedule.py: how
many candidates, at what temperatures; at most `max_attempts`, and a transfer with fewer than `min_accepted`
kept fails), the source base with its adapter (the teacher) completes them, and a new adapter is trained on the
target base on those texts: sequence-level distillation, so the two bases may differ in
architecture and tokenizer. It stops early on the validation set, and transfer_guard.py keeps it only if it beats
the target base alone there, and, where the source adapter fits the target, that too.

Choices the paper leaves open:
- A task's input is a prompt-completion example's prompt; for a plain-text task, the text's first
  PREFIX_WORDS words (the teacher writes the rest).
- Candidates: the seeds' inputs often share a frame (a prompt task's fixed words around its varying part, as
  "Is this message spam? " ... "\nAnswer:"), found as their common prefix and suffix cut at whitespace
  (candidates.py). The generator is shown only the seeds' varying parts (each prompt its own shuffled subset),
  each after a SEP line, then SEP; it writes one more (top-p 0.95, the batch's temperature from
  generation_schedule.TEMPERATURES, stopped at the next SEP), and the frame is put back around it, so that every
  candidate is an input the teacher answers as a task input. Where the seeds' outputs are labels (spam's " yes" /
  " no"), a prompt shows one label's seeds, the labels in turn (generation_schedule.label_groups), so that the
  inputs span the labels. Blank or repeated candidates are dropped without asking the discriminator.
- The discriminator: rank 8 on every linear layer, DISC_STEPS steps on equal numbers of real and generated
  inputs, prompt "<x>\\nIs the above text from the <name> data set?"; a candidate is kept iff the next-token
  logit of " yes" beats " no".
- The teacher decodes greedily, up to 1.5x the longest seed output's tokens. Where the two bases number tokens
  alike, the student also learns the teacher's next-token distribution at every completion position
  (distill.py: a KL term at a temperature), not only the tokens it sampled.
- The student starts from the source adapter where it fits the target, from its projection onto the target's
  layers where only the depth differs and that does better than the target alone (student_start.py), else it is
  a fresh PiSSA adapter (by default) of the source adapter's rank.
- Which synthetic inputs the student learns from is measured per target (students.py): where the discriminator
  refused enough of the inputs written, a second student learns from them as written, and the better one on
  validation is kept.
- The synthetic set is as large as the adapter's real training set (train_log.json), capped by `samples`, and a
  transfer keeps to a time budget (budget.py).
"""

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from serve.adapters.budget import TRAINING, WRITING, Budget
from serve.adapters.candidates import generate, generate_candidates, synthetic_inputs
from serve.adapters.data import PromptExample, TextExample, TrainExample, parse_example
from serve.adapters.distill import Distillation, Teacher, same_tokens
from serve.adapters.generation_schedule import AttemptPlan, Sampling, label_groups
from serve.adapters.load import load_lm, on_device
from serve.adapters.train import LOG_FILE, train_adapter
from serve.adapters.student_start import student_start
from serve.adapters.transfer_guard import TransferFailed, choose, compare, copy_unchanged
from serve.adapters.students import Trainer, input_sets, train_students
from serve.adapters.validation import VALIDATION, read_validation, split_examples, write_validation
from serve.errors import ArtifactError, ConfigError
from serve.store.manifest import StrictModel
from serve.store.writer import atomic_dir
from serve.variants.lora import ADAPTER_CONFIG, TRANSLORA_DIR

SEEDS_FILE = "seeds.jsonl"
TASK_FILE = "task.json"
DISC_DIR = "discriminator"
REPORT_FILE = "translora_report.json"
SEEDS = 5
PREFIX_WORDS = 8
DISC_RANK = 8
DISC_STEPS = 60
YES, NO = " yes", " no"
Progress = Callable[[str, int, int], None]
"""Called as (phase, done, total); the phase as a progress line names it ("writing inputs", "teacher answering",
"student training", "student training (as written)": students.train_students)."""


class TaskInfo(StrictModel):
    name: str
    form: Literal["prompt", "text"]
    max_output_words: int
    """The longest seed output, in words: how long the teacher may write."""
    rank: int | None = None
    """The adapter's rank as trained (a converted PiSSA adapter stores 2r): the student's rank by default."""


def example_input(e: TrainExample) -> str:
    return e.prompt if isinstance(e, PromptExample) else " ".join(e.text.split()[:PREFIX_WORDS])


def example_output(e: TrainExample) -> str:
    return e.completion if isinstance(e, PromptExample) else " " + " ".join(e.text.split()[PREFIX_WORDS:])


def disc_prompt(x: str, name: str) -> str:
    return f"{x.strip()}\nIs the above text from the {name} data set?"


def answer_tokens(tok) -> tuple[int, int]:
    """The token ids of YES and NO: the discriminator's verdict compares their next-token logits, so each must be
    one token, and they must differ (a tokenizer that splits off a leading space, as SentencePiece ones may,
    would compare that piece with itself)."""
    ids = [tok(w, add_special_tokens=False)["input_ids"] for w in (YES, NO)]
    if any(len(i) != 1 for i in ids) or ids[0] == ids[1]:
        raise ConfigError(f"this tokenizer writes {YES!r} and {NO!r} as {ids[0]} and {ids[1]}: a Trans-LoRA "
                          f"discriminator needs each to be one token of its own")
    return ids[0][0], ids[1][0]


@torch.no_grad()
def next_token_logits(model, enc) -> torch.Tensor:
    """The logits after each row of a left-padded batch: [rows, vocab]. Positions count from each row's first
    real token, so a row's logits do not depend on the other rows of its batch (absolute positions, as GPT-2's)."""
    positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return model(**enc, position_ids=positions).logits[:, -1]


class Discriminator:
    """The source base with the discriminator's LoRA: whether an input looks like the task's real ones."""

    def __init__(self, source_base: str | Path, disc_dir: str | Path, name: str):
        self.model, self.tok = load_lm(source_base, disc_dir)
        self.name = name
        self.yes, self.no = answer_tokens(self.tok)

    @torch.no_grad()
    def margins(self, inputs: list[str]) -> torch.Tensor:
        """The next-token logit of YES minus NO after each input's question: [len(inputs)]."""
        enc = on_device(self.tok([disc_prompt(x, self.name) for x in inputs], return_tensors="pt", padding=True),
                        self.model)
        logits = next_token_logits(self.model, enc)
        return logits[:, self.yes] - logits[:, self.no]

    def accepts(self, inputs: list[str]) -> list[bool]:
        return (self.margins(inputs) > 0).tolist()


def read_assets(adapter_dir: str | Path) -> tuple[TaskInfo, list[TrainExample], Path]:
    """(task, seeds, discriminator directory) kept beside an adapter; ArtifactError naming what is missing."""
    root = Path(adapter_dir) / TRANSLORA_DIR
    disc = root / DISC_DIR
    if not (root / TASK_FILE).is_file() or not (root / SEEDS_FILE).is_file() or not (disc / ADAPTER_CONFIG).is_file():
        raise ArtifactError(f"{adapter_dir}: no discriminator beside this adapter (train it with "
                            f"`adapter train --discriminator`)")
    try:
        task = TaskInfo.model_validate_json((root / TASK_FILE).read_text())
        seeds = [parse_example(json.loads(line)) for line in (root / SEEDS_FILE).read_text().splitlines() if line]
    except ValueError as e:
        raise ArtifactError(f"{root}: malformed Trans-LoRA assets ({str(e).splitlines()[0]})") from None
    if not seeds:
        raise ArtifactError(f"{root / SEEDS_FILE}: no seed examples")
    return task, seeds, disc


def train_discriminator(base_dir: str | Path, adapter_dir: str | Path, examples: list[TrainExample], name: str,
                        seeds: int = SEEDS, steps: int = DISC_STEPS, seed: int = 0, validation: int = VALIDATION
                        ) -> dict:
    """Write TRANSLORA_DIR beside the adapter (atomically): the first `seeds` examples, the next ones as a
    validation set (validation.split_examples), the task's form, and a discriminator trained on up to 32 real
    inputs (never the validation set's) against as many the base wrote from the seeds."""
    if len(examples) < seeds + 1:
        raise ConfigError(f"a discriminator needs more than {seeds} examples; got {len(examples)}")
    forms = {type(e) for e in examples}
    if len(forms) != 1:
        raise ConfigError("a discriminator needs examples of one form (all prompt-completion, or all text)")
    kept, held, rest = split_examples(examples, seeds, validation)
    real = [example_input(e) for e in (kept + rest)[:32]]
    model, tok = load_lm(base_dir)
    answer_tokens(tok)
    fake = generate_candidates(model, tok, [example_input(e) for e in kept], name, len(real), seed)
    del model
    data = [PromptExample(prompt=disc_prompt(x, name), completion=answer)
            for pair in zip(real, fake) for x, answer in zip(pair, (YES, NO)) if x.strip()]
    task = TaskInfo(name=name, form="prompt" if PromptExample in forms else "text",
                    max_output_words=max(len(example_output(e).split()) for e in kept),
                    rank=trained_rank(adapter_dir))
    with atomic_dir(Path(adapter_dir) / TRANSLORA_DIR) as stage:
        result = train_adapter(base_dir, data, stage / DISC_DIR, init="lora", rank=DISC_RANK, steps=steps,
                               lr=5e-4, batch_size=8, max_length=160, seed=seed, progress=lambda *_: None)
        (stage / TASK_FILE).write_text(task.model_dump_json(indent=2) + "\n")
        (stage / SEEDS_FILE).write_text("".join(json.dumps(e.model_dump()) + "\n" for e in kept))
        write_validation(stage, held)
    return {"real": len(real), "generated": len(fake), "seeds": len(kept), "validation": len(held),
            "losses": result.losses}


def trained_rank(adapter_dir: str | Path) -> int | None:
    """The rank an adapter was trained at, from the train_log.json `adapter train` writes beside it."""
    return _trained(adapter_dir, "rank")


def trained_examples(adapter_dir: str | Path) -> int | None:
    """How many real examples the adapter was trained on (train_log.json): a transfer wants as many inputs."""
    return _trained(adapter_dir, "examples")


def _trained(adapter_dir: str | Path, key: str) -> int | None:
    try:
        return int(json.loads((Path(adapter_dir) / LOG_FILE).read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class TransferReport:
    source_base: str
    target_base: str
    task: str
    samples_wanted: int
    attempts: int
    """Inputs the target wrote: accepted + rejected + dropped + surplus."""
    accepted: int
    """Kept and completed by the teacher: the new adapter's training inputs."""
    rejected: int
    """Refused by the discriminator."""
    dropped: int
    """Blank, or a repeat of a seed or of an earlier candidate: never shown to the discriminator."""
    surplus: int
    """Passed the filter in a batch that filled the quota."""
    filtered: bool
    rank: int
    losses: list[float]
    seconds: dict[str, float]
    note: str = ""
    steps: int = 0
    """The student's planned steps (validation.student_schedule, or as given); early stopping may end it sooner."""
    lr: float = 0.0
    outcome: str = "student"
    """What out_dir holds: "student" (trained on the target) or "unchanged" (the source adapter as it was, kept
    because the student did not beat it on validation; not transferred); "unguarded": the student,
    written without the guard's comparison deciding (benchmarks only)."""
    validation: dict = field(default_factory=dict)
    """examples, from (the kept validation set, or the seeds for older assets), best_step, curve [{step, loss}]."""
    generation: dict = field(default_factory=dict)
    """generation_schedule.Sampling.summary: min_accepted, max_attempts, planned_attempts (sized by the first
    round's acceptance rate), acceptance_rate, the temperatures used, and each batch's temperature and fates."""
    distilled: str = "sequence"
    """What the student learnt from the teacher: "distribution" (its next-token distributions beside the sampled
    completions, serve/adapters/distill.py) or "sequence" (the completions alone), with why."""
    started_from: str = ""
    """"the source adapter" (it fits the target), or the init the student started from and why."""
    budget: dict = field(default_factory=dict)
    """budget.Budget.summary: the minutes allowed and spent, and the parts the budget cut short."""
    inputs: dict = field(default_factory=dict)
    """Which synthetic inputs the student learnt from (students.train_students): "chosen" (students.KEPT or
    WRITTEN), "why", and per set a student trained on: its inputs, examples (those the teacher answered), steps, lr,
    best_step and its best validation loss and accuracy."""
    compared: dict = field(default_factory=dict)
    """transfer_guard.Comparison: validation losses (and accuracies, where the completions are labels) on the target
    of the student, the target alone and the source adapter unchanged (None where it does not fit; `unfit` says
    why)."""


def validation_set(adapter_dir: str | Path, seeds: list[TrainExample]) -> tuple[list[PromptExample], str]:
    """(the real examples a transfer is validated on, as input -> completion pairs; which they are): the
    validation set kept beside the adapter, or for assets kept before there were validation sets, the seeds."""
    examples = read_validation(adapter_dir)
    source = "validation set" if examples is not None else "seeds (kept before validation sets were)"
    return [PromptExample(prompt=example_input(e), completion=example_output(e))
            for e in (examples if examples is not None else seeds)], source


TEACHER_LENGTH = 1.5
"""The teacher writes up to this many times the longest seed output (in tokens, about two a word), or stops at
its end-of-text token, which the adapter learnt at the end of every completion."""


def teach(source_base: str | Path, adapter_dir: str | Path, task: TaskInfo, inputs: list[str], seed: int,
          tick: Progress, length: float = TEACHER_LENGTH) -> dict[str, TrainExample]:
    """The teacher's (source base + adapter) greedy completions of `inputs`, by input (those it answered with
    nothing left out): the students' training examples."""
    teacher, tok = load_lm(source_base, adapter_dir)
    max_new = max(4, int(length * task.max_output_words * 2))  # about two tokens a word
    outputs: list[str] = []
    for i in range(0, len(inputs), 8):
        outputs += generate(teacher, tok, inputs[i:i + 8], max_new, None, seed)
        tick("teacher answering", len(outputs), len(inputs))
    return {x: PromptExample(prompt=x, completion=y) if task.form == "prompt" else TextExample(text=f"{x}{y}")
            for x, y in zip(inputs, outputs) if y.strip()}


def synthesize(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, plan: AttemptPlan,
               use_filter: bool = True, seed: int = 0, progress: Progress | None = None,
               out_of_time: Callable[[], bool] = lambda: False) -> Sampling:
    """The synthetic inputs a transfer trains on: written by the target base after the adapter's seeds and kept
    by its discriminator (every fresh one without the filter), as `plan` sizes the run; where the seeds' outputs
    are labels, each prompt shows one label's seeds (generation_schedule.label_groups)."""
    task, seeds, disc_dir = read_assets(adapter_dir)
    judge = Discriminator(source_base, disc_dir, task.name).accepts if use_filter else None
    groups = label_groups([example_output(e) for e in seeds])
    return synthetic_inputs(target_base, judge, [example_input(e) for e in seeds], task.name, plan, seed,
                            progress or (lambda *_: None), groups, out_of_time)


def transfer(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, out_dir: str | Path,
             samples: int = 64, max_attempts: int | None = None, use_filter: bool = True, init: str = "pissa",
             rank: int | None = None, steps: int | None = None, lr: float | None = None, seed: int = 0,
             keep_unchanged: bool = True, progress: Progress | None = None,
             min_accepted: int | None = None, teacher_length: float = TEACHER_LENGTH, early_stop: bool = True,
             guard: bool = True, inputs: Sampling | None = None,
             distillation: Distillation | None = Distillation(), start_from_source: bool = True,
             budget_min: float | None = None, measure_inputs: bool = True) -> TransferReport:
    """The source adapter's behaviour as a new adapter of the target base, written to out_dir (atomically, with
    its report and the task's seeds, so that it can move again) only if it beats the target alone on the
    validation set (transfer_guard; else TransferFailed, as with fewer than min_accepted inputs kept, and nothing
    is written). keep_unchanged: the source adapter unchanged, where it fits and beats the target alone, is
    written unless the student beats it (transfer_guard.choose). rank: by default the source adapter's as trained;
    steps, lr: by default scaled to the inputs kept (validation.student_schedule; the rate lower for a student that
    starts from a fitted adapter), the student keeping its best validation point. inputs: what `synthesize`
    wrote for this adapter, target, filter and seed (only the plan is checked), shared by a benchmark's
    configurations; None: written here. distillation: the teacher's next-token distributions learnt too where the
    bases number tokens alike (None: its completions alone). start_from_source: the student starts from the
    source adapter where it fits the target (its rank and init then). samples: at most this many inputs, as many as
    the adapter's real training examples where train_log.json says. budget_min: budget.Budget's bound.
    measure_inputs: a second student on the inputs as written where the filter refused enough of them, the better
    on validation kept (students.py); False: the filter's inputs alone."""
    budget = Budget(budget_min)
    plan = AttemptPlan.build(min(samples, trained_examples(adapter_dir) or samples), max_attempts, min_accepted)
    task, seeds, _ = read_assets(adapter_dir)
    held, held_from = validation_set(adapter_dir, seeds)
    tick = progress or (lambda *_: None)
    t0 = time.perf_counter()
    sampling = _inputs(source_base, adapter_dir, target_base, plan, use_filter, seed, tick, inputs,
                       budget.until(WRITING, "writing"))
    times = {"generate_and_filter": time.perf_counter() - t0}
    sets = input_sets(sampling, use_filter, measure_inputs and early_stop)
    t0 = time.perf_counter()
    taught = teach(source_base, adapter_dir, task, list(dict.fromkeys(x for xs in sets.values() for x in xs)), seed,
                   tick, teacher_length)
    times["teacher"] = time.perf_counter() - t0
    teacher, distilled = _teacher(source_base, adapter_dir, target_base, distillation)
    rank = rank or task.rank or json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["r"]
    with atomic_dir(out_dir) as stage, student_start(source_base, adapter_dir, target_base, init, rank,
                                                     start_from_source, held) as (start, rank, started_from):
        t0 = time.perf_counter()
        trainer = Trainer(target_base, init, rank, start, steps, lr, seed, early_stop, teacher, held,
                          budget.until(TRAINING, "training"), tick)
        student, learnt_from = train_students(trainer, sets, taught, stage)
        del teacher, trainer
        times["train"] = time.perf_counter() - t0
        comparison = compare(source_base, adapter_dir, target_base, stage, held)
        outcome = choose(comparison, keep_unchanged) if guard else "unguarded"
        if outcome == "unchanged":
            copy_unchanged(adapter_dir, stage)
        report = TransferReport(
            str(source_base), str(target_base), task.name, plan.samples, sampling.attempts, len(sampling.accepted),
            sampling.count("rejected"), sampling.count("dropped"), sampling.count("surplus"), use_filter, rank,
            student.result.losses, times, sampling.note(), steps=student.steps, lr=student.lr, outcome=outcome,
            generation=sampling.summary(),
            validation={"examples": len(held), "from": held_from, **student.validation()},
            distilled=distilled, started_from=started_from, budget=budget.summary(), inputs=learnt_from,
            compared=asdict(comparison))
        _write_assets(adapter_dir, stage, report)
    return report


def _write_assets(adapter_dir: str | Path, stage: Path, report: TransferReport) -> None:
    """Beside the new adapter: the source's Trans-LoRA assets (seeds, task, validation set) without its
    discriminator, a LoRA of the source base, and the transfer's report."""
    shutil.copytree(Path(adapter_dir) / TRANSLORA_DIR, stage / TRANSLORA_DIR, ignore=shutil.ignore_patterns(DISC_DIR))
    (stage / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")


def _inputs(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, plan: AttemptPlan,
            use_filter: bool, seed: int, tick: Progress, inputs: Sampling | None,
            out_of_time: Callable[[], bool]) -> Sampling:
    """The inputs a student is taught on: `inputs` where given (written for this plan), else written now;
    TransferFailed, with the figures, where fewer than the plan's floor were kept."""
    if inputs is not None and inputs.plan != plan:
        raise ValueError(f"the inputs given were written for {inputs.plan}, this transfer plans {plan}")
    sampling = inputs or synthesize(source_base, adapter_dir, target_base, plan, use_filter, seed, tick, out_of_time)
    if len(sampling.accepted) < plan.floor:
        raise TransferFailed(sampling.shortfall())
    return sampling


def _teacher(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path,
             distillation: Distillation | None) -> tuple[Teacher | None, str]:
    """(the teacher whose distributions the student learns, or None; what the report says of it)."""
    if distillation is None:
        return None, "sequence (the completions alone, as asked)"
    differ = same_tokens(source_base, target_base)
    if differ is not None:
        return None, f"sequence (the completions alone: {differ})"
    d = distillation
    return (Teacher(source_base, adapter_dir, d),
            f"distribution (KL at temperature {d.temperature:g}, weight {d.weight:g}, beside the completions)")
