"""`manyfold bench translora --ablation`: which of a transfer's choices move its held-out figure (issue 22's
cause analysis).

Start from the transfer as the issue measured it ("as filed": a PiSSA student at lr 5e-4 for 100 steps whatever
was accepted, no early stopping, the teacher cut at 1.5x the longest seed output, the discriminator's filter on)
and change one thing at a time: the learning rate (the PiSSA paper's 2e-5, or scaled to what was accepted),
the steps (scaled to what was accepted), the student's init (LoRA), early stopping on the validation set, a
longer teacher, no filter; then every current default together. Every configuration writes its student whatever
the guard would say (transfer(guard=False)), so that a refused one still has its figure; the same source adapter,
target, seed and held-out set for all of them, and the generation schedule of issue 22's item 4 in all (the
one thing "as filed" cannot go back to). The synthetic inputs depend only on the filter, so they are written once
per filter setting and shared (translora.synthesize): the configurations differ in what is done with the same
inputs. Kept under the work dir like the rest of the bench (a rerun resumes).
"""

import json
import re
from pathlib import Path

from serve.adapters.distill import KD_TEMPERATURE, Distillation
from serve.adapters.generation_schedule import AttemptPlan, Sampling
from serve.adapters.tasks import heldout_examples, task_examples
from serve.adapters.translora import TransferFailed, synthesize, trained_examples, transfer
from serve.bench.translora import FILED_SAMPLES, HELDOUT, RANK, SAMPLES, TRAIN, Evaluations, _log, source_adapter
from serve.bench.translora_table import primary
from serve.store.writer import atomic_write

AS_FILED = {"init": "pissa", "lr": 5e-4, "steps": 100, "early_stop": False, "teacher_length": 1.5,
            "use_filter": True, "kd_temperature": None, "start_from_source": False, "samples": FILED_SAMPLES}
"""The transfer issue 22 measured (bench-results/translora-first-layout.json): on the completions alone, from a
fresh init, 48 inputs."""
ISSUE_36 = {"lr": None, "steps": None, "early_stop": True, "kd_temperature": KD_TEMPERATURE,
            "start_from_source": True, "samples": SAMPLES}
"""Issue 36's defaults: the teacher's distributions learnt too, the student from the source adapter where it fits
(at the lower rate such a student gets), as many inputs as the adapter's real training examples."""
CHANGES: dict[str, dict] = {
    "as filed": {},
    "lr 2e-5 (PiSSA paper)": {"lr": 2e-5},
    "lr scaled to accepted": {"lr": None},
    "steps scaled to accepted": {"steps": None},
    "LoRA init": {"init": "lora"},
    "early stopping": {"early_stop": True},
    "teacher up to 3x": {"teacher_length": 3.0},
    "no filter": {"use_filter": False},
    "current defaults": {"lr": None, "steps": None, "early_stop": True},
    "lr 1e-4, early stopping": {"lr": 1e-4, "early_stop": True},
    "lr 2e-5, early stopping, 300 steps": {"lr": 2e-5, "early_stop": True, "steps": 300},
    "issue 36 defaults": ISSUE_36,
    "issue 36, no distillation": {**ISSUE_36, "kd_temperature": None},
    "issue 36, from its init": {**ISSUE_36, "start_from_source": False},
    "issue 36, 48 inputs": {**ISSUE_36, "samples": FILED_SAMPLES},
    "issue 36, KD temperature 1": {**ISSUE_36, "kd_temperature": 1.0},
    "issue 36, KD temperature 4": {**ISSUE_36, "kd_temperature": 4.0},
    "issue 36, lr 5e-4": {**ISSUE_36, "lr": 5e-4},
}
"""Each configuration: what it changes from AS_FILED. "lr 1e-4, early stopping" and "lr 2e-5, early stopping, 300
steps" combine the changes the first headlines run showed mattered (a lower rate, early stopping), as candidates
for new defaults. "issue 36, lr 5e-4": the rate issue 36's students started from the source adapter at, before
the lower one (validation.FITTED_LR) was measured better."""


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


CONFIGS = tuple(slug(name) for name in CHANGES)
"""The configurations by the names `--configs` takes."""


def ablation_runs(work: Path, source: Path, target: tuple[str, Path], task: str, src: Path, seed: int,
                  evals: Evaluations, configs: tuple[str, ...]) -> dict:
    """{configuration: {"changes", "heldout", "accepted", "steps", "lr", "best_step"} or {"failed": why}} for one
    task on one target and seed, for the configurations whose slugs are in configs; each transfer kept in work (a
    failed one as NAME.failed)."""
    name, base = target
    held = heldout_examples(task, HELDOUT)
    inputs: dict[tuple[bool, int], Sampling] = {}
    """By filter and inputs wanted: the synthetic inputs every configuration with those trains on, written once
    (and kept in work, so that a configuration added later trains on them too)."""

    def shared(use_filter: bool, samples: int) -> Sampling:
        plan = AttemptPlan.build(min(samples, trained_examples(src) or samples))
        kept = work / "ablation" / (f"{name}-{task}-s{seed}-inputs-{'filtered' if use_filter else 'unfiltered'}"
                                    f"{'' if plan.samples == FILED_SAMPLES else f'-{plan.samples}'}.json")
        if (use_filter, plan.samples) not in inputs:
            loaded = Sampling.from_dict(json.loads(kept.read_text())) if kept.is_file() else None
            if loaded is None or loaded.plan != plan:  # none kept, or kept for another plan: written again
                loaded = synthesize(source, src, base, plan, use_filter, seed)
                atomic_write(kept, [(json.dumps(loaded.to_dict()) + "\n").encode()])
            inputs[use_filter, plan.samples] = loaded
        return inputs[use_filter, plan.samples]

    out = {}
    for config, change in CHANGES.items():
        if slug(config) not in configs:
            continue
        moved = work / "ablation" / f"{name}-{task}-s{seed}-{slug(config)}"
        failed = moved.with_name(moved.name + ".failed")
        if not moved.exists() and not failed.exists():
            _log(f"ablation {name}, {task}, seed {seed}: {config}")
            choices = {**AS_FILED, **change}
            kd = choices.pop("kd_temperature")
            try:
                transfer(source, src, base, moved, rank=RANK, seed=seed, guard=False,
                         inputs=shared(choices["use_filter"], choices["samples"]),
                         distillation=None if kd is None else Distillation(temperature=kd), **choices)
            except TransferFailed as e:  # too few inputs accepted: nothing to train
                atomic_write(failed, [(str(e) + "\n").encode()])
        if failed.exists():
            out[config] = {"changes": change, "failed": failed.read_text().strip()}
            continue
        report = json.loads((moved / "translora_report.json").read_text())
        early = {**AS_FILED, **change}["early_stop"]
        out[config] = {"changes": change, "heldout": evals(task, base, moved, held), "accepted": report["accepted"],
                       "steps": report["steps"], "lr": report["lr"],
                       "best_step": report["validation"]["best_step"] if early else None}
    return out


def ablation_table(work: Path, source: Path, targets: dict[str, Path], tasks: tuple[str, ...], seeds: list[int],
                   evals: Evaluations, configs: tuple[str, ...]) -> dict:
    """{target: {task: {"seeds": {seed: ablation_runs}, "target alone": its held-out figures}}}."""
    out: dict = {}
    for task in tasks:
        train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
        for s in seeds:
            src = source_adapter(work, source, task, train, s)
            for name, base in targets.items():
                cell = out.setdefault(name, {}).setdefault(task, {"seeds": {}})
                cell["seeds"][s] = ablation_runs(work, source, (name, base), task, src, s, evals, configs)
                cell.setdefault("unchanged", {})[s] = evals(task, base, src, held)
                cell["target alone"] = evals(task, base, None, held)
    return out


def print_ablation(table: dict) -> None:
    for target, tasks in table.items():
        for task, cell in tasks.items():
            metric, higher = primary(task)
            alone = cell["target alone"][metric]
            unchanged = ", ".join(f"{u[metric]:.3f} (seed {s})" for s, u in cell.get("unchanged", {}).items())
            print(f"\nablation, {task} on {target} (held-out {metric}, {'higher' if higher > 0 else 'lower'} is "
                  f"better; the target alone: {alone:.3f}; the source adapter unchanged: {unchanged})")
            print(f"{'configuration':<36}{'seed':>5}{'accepted':>9}{'steps':>7}{'lr':>9}{metric:>10}"
                  f"{'vs alone':>10}{'vs filed':>10}")
            for s, runs in cell["seeds"].items():
                filed = runs.get("as filed", {}).get("heldout", {}).get(metric)
                for config, r in runs.items():
                    if "failed" in r:
                        print(f"{config:<36}{s:>5}  failed: {r['failed'][:80]}")
                        continue
                    v = r["heldout"][metric]
                    vs_filed = f"{v - filed:>+10.3f}" if filed is not None else f"{'-':>10}"
                    print(f"{config:<36}{s:>5}{r['accepted']:>9}{r['steps']:>7}{r['lr']:>9.1e}{v:>10.3f}"
                          f"{v - alone:>+10.3f}{vs_filed}")
