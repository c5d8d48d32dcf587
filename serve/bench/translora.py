"""`manyfold bench translora`: Trans-LoRA on three real tasks and three target bases, over seeds, and PiSSA
against LoRA at the same budget.

Source base: SmolLM2-135M-Instruct. Targets (translora_targets.py): the same model after NeuZip k=0, a new
version continued-trained on fortunes, and a deeper model (SmolLM2 grown to 33 layers, then trained on
fortunes), where the source adapter's layers, matched by name, no longer line up. Tasks from the packaged data: SMS spam (" yes" / " no": held-out
accuracy, answer by the larger next-token logit), BBC headlines from an article's opening, and tweets continued
from their first words (held-out loss of the completion tokens, lower is better). For each task and seed: the
source adapter (PiSSA, trained with a discriminator, on the task's examples less the validation set
`adapter train --discriminator` holds out) on the source base; then per target: the target base alone (one run:
no seed in it), the source adapter applied unchanged, the Trans-LoRA adapter (its guard reads that validation
set), its student (what the transfer trained, whichever the guard kept), the same without the discriminator's
filter, and an upper bound trained on the target with the same real data. The transfers run as `manyfold
translora` does by default (as many inputs as the real training set, the teacher's distributions distilled, the
student from the source adapter where it fits, steps and rate scaled to the inputs accepted, early stopping on the
validation set), except that the student is always written (guard=False) and the guard's choice
(transfer_guard.choose, on the figures in its report) is made here, so that the student has its figure even where
the source adapter unchanged is kept; every other adapter trains STEPS steps at LR. The
headline per task is the gap recovered: (target alone - transferred) / (target alone - upper bound), per seed. Then PiSSA, pissa_niter_4 and LoRA trained on the source base with the same rank, steps,
learning rate and seeds: loss curves (PNG + JSON) and held-out metric. Rows report mean and spread over seeds
(translora_table.py).
Every adapter, transfer and evaluation is kept under the work dir, so a rerun resumes where one stopped (a work
dir from before the students trained with transfer's defaults holds students trained at STEPS and LR: start a
new one).
"""

import json
import time
from pathlib import Path

import torch

from serve.adapters import transfer_guard
from serve.adapters.budget import MINUTES
from serve.adapters.data import PromptExample, TrainExample
from serve.adapters.load import load_lm
from serve.adapters.tasks import heldout_examples, task_examples
from serve.adapters.train import train_adapter
from serve.adapters.translora import (SEEDS, YES, TransferFailed, answer_tokens, next_token_logits,
                                      train_discriminator, transfer)
from serve.adapters.validation import completion_loss, split_examples
from serve.bench.report import finish, machine
from serve.bench.translora_table import ALONE, MOVED, ROWS, STUDENT, UNCHANGED, UNFILTERED, UPPER, mean_curve, \
    init_verdicts, plot, primary, print_report, summarize, task_verdicts, gaps_recovered
from serve.bench.translora_targets import TARGETS, target_base, target_info
from serve.errors import ConfigError
from serve.store.writer import atomic_write

TASKS = ("spam", "headlines", "tweets")
TRAIN, HELDOUT = 128, 100
RANK, STEPS, LR = 8, 48, 5e-4
SAMPLES = TRAIN
"""Synthetic inputs a transfer may keep: as many as the adapter's real training examples (translora.transfer)."""
FILED_SAMPLES = 48
"""What transfers kept before issue 36 (the ablation's "as filed")."""
INITS = ("pissa", "pissa_niter_4", "lora")
EVALS_FILE = "evaluations.json"


@torch.no_grad()
def evaluate(task: str, base: Path, adapter: Path | None, examples: list[PromptExample]) -> dict[str, float]:
    """Held-out metrics: "loss" (mean loss per completion token, every task) and, for spam, "accuracy" (the
    larger next-token logit of " yes" and " no" after the prompt)."""
    model, tok = load_lm(base, adapter)
    out = {"loss": completion_loss(model, tok, examples)}  # the transfer guard's validation loss, on held-out data
    if task == "spam":
        yes, no = answer_tokens(tok)
        correct = 0
        for i in range(0, len(examples), 16):
            chunk = examples[i:i + 16]
            logits = next_token_logits(model, tok([e.prompt for e in chunk], return_tensors="pt", padding=True))
            pred = (logits[:, yes] > logits[:, no]).tolist()
            correct += sum(p == (e.completion == YES) for p, e in zip(pred, chunk))
        out["accuracy"] = correct / len(examples)
    return out


class Evaluations:
    """Held-out metrics kept in the work dir by (task, base, adapter): a rerun, or a second target, does not
    evaluate the same adapter twice."""

    def __init__(self, path: Path):
        self.path = path
        self.done: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.is_file() else {}

    def __call__(self, task: str, base: Path, adapter: Path | None, examples: list[PromptExample]) -> dict:
        key = f"{task}|{len(examples)}|{base}|{adapter}"
        if key not in self.done:
            self.done[key] = evaluate(task, base, adapter, examples)
            atomic_write(self.path, [(json.dumps(self.done, indent=2) + "\n").encode()])
        return self.done[key]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _train(base: Path, examples: list[TrainExample], out: Path, init: str, seed: int) -> None:
    if not out.exists():
        _log(f"training {out.name} ({init}, rank {RANK}, {STEPS} steps, seed {seed})")
        train_adapter(base, examples, out, init=init, rank=RANK, steps=STEPS, lr=LR, seed=seed,
                      progress=lambda *_: None)


def source_adapter(work: Path, source: Path, task: str, train: list[TrainExample], seed: int) -> Path:
    """The task's source adapter for one seed, with its discriminator: trained, as `adapter train --discriminator`
    does, on the seeds and the rest, never on the validation set the transfer's guard reads."""
    seeds, _, rest = split_examples(train, SEEDS)
    src = work / f"{task}-s{seed}-source"
    _train(source, seeds + rest, src, "pissa", seed)
    if not (src / "translora").exists():
        _log(f"training {src.name}'s discriminator")
        train_discriminator(source, src, train, task, seeds=SEEDS, seed=seed)
    return src


def seed_runs(work: Path, source: Path, target: tuple[str, Path], task: str, src: Path,
              train: list[TrainExample], seed: int, rows: tuple[str, ...] = ROWS) -> tuple[dict, dict, dict]:
    """One seed on one target: (adapter of each of `rows` but the target alone or None where it made none,
    transfer reports, failures)."""
    name, base = target
    seeds, _, rest = split_examples(train, SEEDS)
    real = work / f"{name}-{task}-s{seed}-real"
    _train(base, seeds + rest, real, "pissa", seed)
    reports, failures, moved, kept = {}, {}, {}, {}
    for row, use_filter in ((MOVED, True), (UNFILTERED, False)):
        if row not in rows:
            continue
        moved[row] = work / f"{name}-{task}-s{seed}-{'filtered' if use_filter else 'unfiltered'}"
        failed = moved[row].with_name(moved[row].name + ".failed")
        if not moved[row].exists() and not failed.exists():
            _log(f"{name}, {task}, seed {seed}: {row}, up to {SAMPLES} synthetic inputs")
            try:
                transfer(source, src, base, moved[row], samples=SAMPLES, use_filter=use_filter, rank=RANK,
                         seed=seed, budget_min=MINUTES, guard=False)
            except TransferFailed as e:
                atomic_write(failed, [(str(e) + "\n").encode()])  # a rerun does not try again
        if failed.exists():
            failures[row] = failed.read_text().strip()
            continue
        reports[row] = json.loads((moved[row] / "translora_report.json").read_text())
        try:
            outcome = transfer_guard.choose(transfer_guard.Comparison(**reports[row]["compared"]), True)
            reports[row]["kept"] = outcome
            kept[row] = (base, src if outcome == "unchanged" else moved[row])
        except TransferFailed as e:
            failures[row] = str(e)
    student = (base, moved[MOVED]) if MOVED in reports else None
    adapters = {ROWS[0]: (source, src), ALONE: None, UNCHANGED: (base, src), MOVED: kept.get(MOVED),
                STUDENT: student, UNFILTERED: kept.get(UNFILTERED), UPPER: (base, real)}
    return {row: None if row in failures else adapters[row] for row in rows}, reports, failures


def task_runs(work: Path, source: Path, target: tuple[str, Path], task: str, sources: list[Path],
              evals: Evaluations, rows: tuple[str, ...] = ROWS) -> dict:
    """One task on one target over every seed: each row's runs and summary, reports, failures, verdicts."""
    train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
    runs: dict[str, list] = {row: [] for row in rows}
    reports: dict[str, list] = {row: [] for row in (MOVED, UNFILTERED) if row in rows}
    failures: dict[str, dict[int, str]] = {}
    for seed, src in enumerate(sources):
        adapters, rep, fail = seed_runs(work, source, target, task, src, train, seed, rows)
        _log(f"{target[0]}, {task}, seed {seed}: evaluating on {len(held)} held-out examples")
        for row, a in adapters.items():
            if row != ALONE:
                runs[row].append(None if a is None else evals(task, a[0], a[1], held))
        for row in reports:
            reports[row].append(rep.get(row))
        for row, why in fail.items():
            failures.setdefault(row, {})[seed] = why
    runs[ALONE] = [evals(task, target[1], None, held)]  # no seed in it: one run
    rows = {row: summarize(r) for row, r in runs.items()}
    return {"metric": primary(task)[0], "heldout": len(held), "runs": runs, "rows": rows,
            "reports": {row: [r and {**{k: r[k] for k in ("accepted", "attempts", "seconds", "kept", "steps", "lr")
                                        if k in r},
                                     "best_step": r["validation"].get("best_step")} for r in rs]
                        for row, rs in reports.items()},
            "failures": failures, "verdicts": task_verdicts(task, rows), "gaps": gaps_recovered(task, runs)}


def transfer_table(work: Path, source: Path, targets: dict[str, Path], tasks: tuple[str, ...], seeds: int,
                   evals: Evaluations, rows: tuple[str, ...] = ROWS) -> dict:
    """{target: {task: task_runs}}; each task's source adapters are trained once and moved to every target."""
    out: dict[str, dict] = {name: {} for name in targets}
    for task in tasks:
        train = task_examples(task, "train", TRAIN)
        sources = [source_adapter(work, source, task, train, seed) for seed in range(seeds)]
        for name, base in targets.items():
            out[name][task] = task_runs(work, source, (name, base), task, sources, evals, rows)
    return out


def init_table(work: Path, source: Path, tasks: tuple[str, ...], seeds: int, evals: Evaluations) -> dict:
    """PiSSA, pissa_niter_4 and LoRA on the source base per task and seed: curves, held-out metrics, verdicts."""
    out = {}
    for task in tasks:
        train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
        runs = {}
        for init in INITS:
            per_seed = []
            for seed in range(seeds):
                d = work / f"{task}-init-{init}-s{seed}"
                _train(source, train, d, init, seed)
                log = json.loads((d / "train_log.json").read_text())
                per_seed.append({"losses": [e["loss"] for e in log["log"]], "heldout": evals(task, source, d, held),
                                 "train_seconds": log["seconds"], "init_seconds": log["init_seconds"]})
            runs[init] = {"seeds": per_seed, "curve": mean_curve([x["losses"] for x in per_seed]),
                          "heldout": summarize([x["heldout"] for x in per_seed])}
        out[task] = {"runs": runs, "verdicts": init_verdicts(runs, STEPS)}
    return out


def choose(given: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated subset of `known` (all of them where not given), in the order given."""
    if given is None:
        return known
    names = tuple(n.strip() for n in given.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"--{what}: {', '.join(unknown) or 'nothing given'} not among {', '.join(known)}")
    return names


def run_translora_bench(out: Path, work: Path | None = None, seeds: int = 3, tasks: tuple[str, ...] = TASKS,
                        targets: tuple[str, ...] = TARGETS, inits: bool = True, ablation: bool = False,
                        unfiltered: bool = True, configs: tuple[str, ...] | None = None) -> dict:
    """The whole bench (or the subset of tasks and targets given): tables on stdout, JSON at out, PNG beside.
    ablation: the ablation instead (serve/bench/translora_ablation.py), of configs (their slugs; all where None).
    unfiltered: False leaves out the
    transfer without the discriminator's filter (a third of the bench's time; the ablation measures the filter)."""
    from serve.data.cache import home
    from serve.data.models import smollm2_dir

    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    work = work or home() / "bench-translora"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = smollm2_dir()
    bases = {name: target_base(name, work, _log) for name in targets}
    evals = Evaluations(work / EVALS_FILE)
    if ablation:
        from serve.bench.translora_ablation import CONFIGS, ablation_table, print_ablation

        table = ablation_table(work, source, bases, tasks, seeds, evals, configs or CONFIGS)
        report = {"machine": machine(), "source": "SmolLM2-135M-Instruct", "seeds": seeds, "rank": RANK,
                  "samples": SAMPLES, "ablation": table}
        report["seconds"] = time.perf_counter() - t0
        return finish(report, out, lambda r: print_ablation(r["ablation"]))
    report = {"machine": machine(), "source": "SmolLM2-135M-Instruct", "seeds": seeds, "rank": RANK,
              "steps": STEPS, "lr": LR, "train_examples": TRAIN, "samples": SAMPLES,
              "targets": {name: target_info(name, base) for name, base in bases.items()},
              "transfer": transfer_table(work, source, bases, tasks, seeds, evals,
                                         ROWS if unfiltered else tuple(r for r in ROWS if r != UNFILTERED)),
              "inits": init_table(work, source, tasks, seeds, evals) if inits else {}}
    report["seconds"] = time.perf_counter() - t0
    finish(report, out, print_report)
    if report["inits"]:
        plot(report["inits"], RANK, LR, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    return report
