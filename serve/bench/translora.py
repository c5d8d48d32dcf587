"""`manyfold bench translora`: Trans-LoRA on five real tasks and five target bases, over seeds, and PiSSA against
LoRA at the same budget.

Source base: SmolLM2-135M-Instruct. Targets (translora_targets.py): the same model after NeuZip k=0, a new version
continued-trained on fortunes, and three of other shapes, where the source adapter matched by module name no
longer lines up: SmolLM2 grown to 33 layers, to 35 layers (inserted elsewhere), and with wider MLPs, each then
trained on fortunes. Tasks from the packaged data (serve/adapters/tasks.py): SMS spam (" yes" / " no"), BBC
headlines from an article's opening and tweets continued from their first words, on which the transfer's defaults
were chosen (TUNED); and BBC topics and tweets' sentiment, on which nothing was (HELD_OUT, a table apart). Label
tasks are judged by held-out accuracy (the likeliest label), the others by held-out loss of the completion tokens.

For each task and seed: the source adapter (PiSSA, trained with a discriminator, on the task's examples less the
validation set `adapter train --discriminator` holds out) on the source base; then per target: the target base
alone (one run: no seed in it), the source adapter applied unchanged, the Trans-LoRA adapter (its guard reads
that validation set), its student (what the transfer trained, whichever the guard kept), the same without the
discriminator's filter, and an upper bound trained on the target with the same real data. The transfers run as
`manyfold translora` does by default, except that the student is always written (guard=False) and the guard's
choice (transfer_guard.choose, on the figures in its report) is made here, so that the student has its figure
even where the source adapter unchanged is kept; every other adapter trains STEPS steps at LR. The headline per
task is the gap recovered: (target alone - transferred) / (target alone - upper bound), per seed. Then PiSSA,
pissa_niter_4 and LoRA trained on the source base with the same rank, steps, learning rate and seeds: loss curves
(PNG + JSON) and held-out metric. Rows report mean and spread over seeds (translora_table.py).

Every adapter, transfer and evaluation is kept under the work dir, so a rerun resumes where one stopped. Seeds
run apart (`--first-seed`, on another machine or day) merge into one report (`--merge`, merge_reports).
"""

import json
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from serve.adapters import transfer_guard
from serve.adapters.budget import MINUTES
from serve.adapters.data import PromptExample, TrainExample
from serve.adapters.load import load_lm
from serve.adapters.student_start import lora_module
from serve.adapters.tasks import LABEL_TASKS, heldout_examples, task_examples
from serve.adapters.train import train_adapter
from serve.adapters.translora import SEEDS, TransferFailed, train_discriminator, transfer
from serve.adapters.validation import completion_loss, labels_of, score, trained_on
from serve.bench.report import finish, machine
from serve.bench.translora_table import (ALONE, FILTERED, HELD_OUT, MOVED, ROWS, STUDENT, TRANSFERS, TUNED, UNCHANGED,
                                         UNFILTERED, UPPER, Run, gaps_recovered, init_verdicts, mean_curve, plot,
                                         primary, print_report, summarize, task_verdicts)
from serve.bench.translora_targets import TARGETS, target_base, target_info
from serve.errors import ConfigError
from serve.store.tensors import SafetensorsSource
from serve.store.writer import atomic_dir, atomic_write
from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

TASKS = TUNED + HELD_OUT
TRAIN, HELDOUT = 128, 100
RANK, STEPS, LR = 8, 48, 5e-4
SAMPLES = TRAIN
"""Synthetic inputs a transfer may keep: as many as the adapter's real training examples (translora.transfer)."""
TRANSFER_DIRS = {MOVED: "moved", FILTERED: "filtered", UNFILTERED: "unfiltered"}
"""Where each transfer row's adapter is kept in the work dir: "-filtered" is what the Trans-LoRA row wrote before
its inputs were measured, so that a rerun finds those transfers."""
TRANSFER_OPTIONS = {MOVED: {}, FILTERED: {"measure_inputs": False}, UNFILTERED: {"use_filter": False}}
"""translora.transfer's options per transfer row, beside the defaults every row shares."""
FILED_SAMPLES = 48
"""What transfers kept before issue 36 (the ablation's "as filed")."""
INITS = ("pissa", "pissa_niter_4", "lora")
EVALS_FILE = "evaluations.json"


@torch.no_grad()
def evaluate(task: str, base: Path, adapter: Path | None, examples: list[PromptExample]) -> dict[str, float]:
    """Held-out metrics: "loss" (mean loss per completion token) and, for a label task, "accuracy" (the label
    whose tokens are likeliest after the prompt: validation.score, as the transfer's guard reads it)."""
    model, tok = load_lm(base, adapter)
    if task not in LABEL_TASKS:
        return {"loss": completion_loss(model, tok, examples)}
    s = score(model, tok, examples, labels_of(examples))
    return {"loss": s.loss, "accuracy": s.accuracy}


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
    src = work / f"{task}-s{seed}-source"
    _train(source, trained_on(train, SEEDS), src, "pissa", seed)
    if not (src / "translora").exists():
        _log(f"training {src.name}'s discriminator")
        train_discriminator(source, src, train, task, seeds=SEEDS, seed=seed)
    return src


def seed_runs(work: Path, source: Path, target: tuple[str, Path], task: str, src: Path,
              train: list[TrainExample], seed: int, rows: tuple[str, ...] = ROWS) -> tuple[dict, dict, dict]:
    """One seed on one target: (adapter of each of `rows` but the target alone or None where it made none,
    transfer reports, failures)."""
    name, base = target
    real = work / f"{name}-{task}-s{seed}-real"
    _train(base, trained_on(train, SEEDS), real, "pissa", seed)
    reports, failures, moved, kept = {}, {}, {}, {}
    for row in TRANSFERS:
        if row not in rows:
            continue
        moved[row] = work / f"{name}-{task}-s{seed}-{TRANSFER_DIRS[row]}"
        failed = moved[row].with_name(moved[row].name + ".failed")
        if not moved[row].exists() and not failed.exists():
            _log(f"{name}, {task}, seed {seed}: {row}, up to {SAMPLES} synthetic inputs")
            try:
                transfer(source, src, base, moved[row], samples=SAMPLES, rank=RANK, seed=seed, budget_min=MINUTES,
                         guard=False, **TRANSFER_OPTIONS[row])
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
    unchanged = by_module_name(src, base, work / f"{name}-{task}-s{seed}-by-name")
    adapters = {ROWS[0]: (source, src), ALONE: None, UNCHANGED: (base, unchanged), STUDENT: student,
                UPPER: (base, real)} | {row: kept.get(row) for row in TRANSFERS}
    return {row: None if row in failures else adapters[row] for row in rows}, reports, failures


def by_module_name(src: Path, base: Path, out: Path) -> Path:
    """The source adapter as a target of another shape loads it by module name: every module whose tensors fit
    the target's weight of that name, the others dropped (PEFT refuses a size mismatch: the wider target's MLPs),
    kept at out; the adapter itself where every module fits (the deeper targets: their layers shift, none
    resizes)."""
    shapes = SafetensorsSource(base).shapes()
    tensors = load_file(src / ADAPTER_WEIGHTS)
    modules: dict[str, bool] = {}
    for name, t in tensors.items():
        module, part = lora_module(name)
        want, axis = shapes.get(f"{module}.weight"), 1 if part.startswith("A") else 0  # A [r, in], B [out, r]
        modules[module] = modules.get(module, True) and want is not None and t.shape[axis] == want[axis]
    if all(modules.values()):
        return src
    if not out.exists():
        with atomic_dir(out) as stage:
            save_file({n: t for n, t in tensors.items() if modules[lora_module(n)[0]]}, stage / ADAPTER_WEIGHTS,
                      metadata={"format": "pt"})
            shutil.copy2(src / ADAPTER_CONFIG, stage / ADAPTER_CONFIG)
    return out


def task_runs(work: Path, source: Path, target: tuple[str, Path], task: str, sources: dict[int, Path],
              evals: Evaluations, rows: tuple[str, ...] = ROWS) -> dict:
    """One task on one target over the seeds of `sources` ({seed: source adapter}): each row's runs and summary,
    reports, failures, verdicts."""
    train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
    runs: dict[str, list] = {row: [] for row in rows}
    reports: dict[str, list] = {row: [] for row in TRANSFERS if row in rows}
    failures: dict[str, dict[int, str]] = {}
    for seed, src in sources.items():
        adapters, rep, fail = seed_runs(work, source, target, task, src, train, seed, rows)
        _log(f"{target[0]}, {task}, seed {seed}: evaluating on {len(held)} held-out examples")
        for row, a in adapters.items():
            if row != ALONE:
                runs[row].append(None if a is None else evals(task, a[0], a[1], held))
        for row in reports:
            r = rep.get(row)
            reports[row].append(r and {**{k: r[k] for k in ("accepted", "attempts", "seconds", "kept", "steps", "lr")
                                          if k in r}, "best_step": r["validation"].get("best_step"),
                                       "chosen": r.get("inputs", {}).get("chosen")})
        for row, why in fail.items():
            failures.setdefault(row, {})[seed] = why
    runs[ALONE] = [evals(task, target[1], None, held)]  # no seed in it: one run
    return task_summary(task, len(held), list(sources), runs, reports, failures)


def task_summary(task: str, heldout: int, seeds: list[int], runs: dict[str, list], reports: dict[str, list],
                 failures: dict[str, dict[int, str]]) -> dict:
    """A task's entry in the report from its runs (per row, one per seed in `seeds`; the target alone once)."""
    rows = {row: summarize(r) for row, r in runs.items()}
    return {"metric": primary(task)[0], "heldout": heldout, "seeds": seeds, "runs": runs, "rows": rows,
            "reports": reports, "failures": failures, "verdicts": task_verdicts(task, rows),
            "gaps": gaps_recovered(task, runs)}


def transfer_table(work: Path, source: Path, targets: dict[str, Path], tasks: tuple[str, ...], seeds: list[int],
                   evals: Evaluations, rows: tuple[str, ...] = ROWS) -> dict:
    """{target: {task: task_runs}}; each task's source adapters are trained once and moved to every target."""
    out: dict[str, dict] = {name: {} for name in targets}
    for task in tasks:
        train = task_examples(task, "train", TRAIN)
        sources = {seed: source_adapter(work, source, task, train, seed) for seed in seeds}
        for name, base in targets.items():
            out[name][task] = task_runs(work, source, (name, base), task, sources, evals, rows)
    return out


def init_table(work: Path, source: Path, tasks: tuple[str, ...], seeds: list[int], evals: Evaluations) -> dict:
    """PiSSA, pissa_niter_4 and LoRA on the source base per task and seed: curves, held-out metrics, verdicts."""
    out = {}
    for task in tasks:
        train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
        runs = {}
        for init in INITS:
            per_seed = []
            for seed in seeds:
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
                        unfiltered: bool = True, configs: tuple[str, ...] | None = None, first_seed: int = 0,
                        filtered: bool = True) -> dict:
    """The whole bench (or the subset of tasks and targets given) for seeds first_seed .. first_seed + seeds - 1:
    tables on stdout, JSON at out, PNG beside. ablation: the ablation instead (serve/bench/translora_ablation.py),
    of configs (their slugs; all where None). unfiltered, filtered: False leaves out the transfer without the
    discriminator's filter, or with one student on its inputs only (each a transfer of its own)."""
    from serve.data.cache import home
    from serve.data.models import smollm2_dir

    if seeds < 1 or first_seed < 0:
        raise ConfigError(f"--seeds must be at least 1 and --first-seed at least 0, got {seeds} and {first_seed}")
    seed_list = list(range(first_seed, first_seed + seeds))
    work = work or home() / "bench-translora"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = smollm2_dir()
    bases = {name: target_base(name, work, _log) for name in targets}
    evals = Evaluations(work / EVALS_FILE)
    if ablation:
        from serve.bench.translora_ablation import CONFIGS, ablation_table, print_ablation

        table = ablation_table(work, source, bases, tasks, seed_list, evals, configs or CONFIGS)
        report = {"machine": machine(), "source": "SmolLM2-135M-Instruct", "seeds": seed_list, "rank": RANK,
                  "samples": SAMPLES, "ablation": table}
        report["seconds"] = time.perf_counter() - t0
        return finish(report, out, lambda r: print_ablation(r["ablation"]))
    skipped = {row for row, run in ((UNFILTERED, unfiltered), (FILTERED, filtered)) if not run}
    report = {"machine": machine(), "source": "SmolLM2-135M-Instruct", "seeds": seed_list, "rank": RANK,
              "steps": STEPS, "lr": LR, "train_examples": TRAIN, "samples": SAMPLES,
              "targets": {name: target_info(name, base) for name, base in bases.items()},
              "transfer": transfer_table(work, source, bases, tasks, seed_list, evals,
                                         tuple(r for r in ROWS if r not in skipped)),
              "inits": init_table(work, source, tasks, seed_list, evals) if inits else {}}
    report["seconds"] = time.perf_counter() - t0
    finish(report, out, print_report)
    if report["inits"]:
        plot(report["inits"], RANK, LR, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    return report


class _SeedRun(NamedTuple):
    """One seed of a target's task, as a part's report holds it (merge_reports)."""

    file: str
    runs: dict[str, Run]
    reports: dict[str, dict | None]
    failures: dict[str, str]


def merge_reports(parts: list[tuple[str, dict]]) -> dict:
    """One report from the transfer tables of bench runs over other seeds ((name, report) each, as `--out`
    wrote them: a run of every seed does not fit one machine's session): per target and task, each row's runs
    in seed order, the target alone from the first part that ran it, summaries, verdicts and gaps drawn again.
    A seed of a target's task in two parts is refused, as is a part from before reports named their seeds."""
    found: dict[tuple[str, str], dict] = {}
    for name, part in parts:
        if not part.get("transfer") or not isinstance(part.get("seeds"), list):
            raise ConfigError(f"{name}: no transfer table with its seeds named (a bench run from before "
                              f"--first-seed, or an ablation): run it again")
        for target, tasks in part["transfer"].items():
            for task, t in tasks.items():
                into = found.setdefault((target, task), {"heldout": t["heldout"], "alone": t["runs"][ALONE],
                                                         "seeds": {}})
                for i, seed in enumerate(t["seeds"]):
                    if seed in into["seeds"]:
                        raise ConfigError(f"{name}: seed {seed} of {task} on {target} is in "
                                          f"{into['seeds'][seed].file} too")
                    into["seeds"][seed] = _SeedRun(
                        name, {row: r[i] for row, r in t["runs"].items() if row != ALONE},
                        {row: r[i] for row, r in t["reports"].items()},
                        {row: why for row, whys in t["failures"].items()
                         for s, why in whys.items() if int(s) == seed})  # JSON's keys are strings
    transfer: dict[str, dict[str, dict]] = {}
    for (target, task), into in found.items():
        seeds = sorted(into["seeds"])
        per = [into["seeds"][s] for s in seeds]
        runs = {row: into["alone"] if row == ALONE else [p.runs.get(row) for p in per]
                for row in ROWS if row == ALONE or any(row in p.runs for p in per)}
        reports = {row: [p.reports.get(row) for p in per] for row in TRANSFERS
                   if any(row in p.reports for p in per)}
        failures: dict[str, dict[int, str]] = {}
        for seed, p in zip(seeds, per):
            for row, why in p.failures.items():
                failures.setdefault(row, {})[seed] = why
        transfer.setdefault(target, {})[task] = task_summary(task, into["heldout"], seeds, runs, reports, failures)
    first = parts[0][1]
    return {"machine": "; ".join(dict.fromkeys(p["machine"] for _, p in parts)), "source": first["source"],
            "seeds": sorted({s for _, p in parts for s in p["seeds"]}),
            **{k: first[k] for k in ("rank", "steps", "lr", "train_examples", "samples")},
            "targets": {k: v for _, p in parts for k, v in p["targets"].items()}, "transfer": transfer,
            "inits": {}, "parts": [{"file": name, "machine": p["machine"], "seeds": p["seeds"],
                                    "seconds": p["seconds"]} for name, p in parts]}


def merge_files(paths: list[Path], out: Path) -> dict:
    """`--merge`: merge_reports of the JSON files, tables on stdout, JSON at out."""
    parts = []
    for path in paths:
        try:
            parts.append((path.name, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            raise ConfigError(f"--merge: {path}: {e}") from None
    try:
        merged = merge_reports(parts)
    except (KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"--merge: {', '.join(p.name for p in paths)}: not reports of `bench translora` "
                          f"({type(e).__name__}: {e})") from None
    return finish(merged, out, print_report)
