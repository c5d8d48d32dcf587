"""`manyfold bench translora`: Trans-LoRA on two real tasks, and PiSSA against LoRA at the same budget.

Source base: SmolLM2-135M-Instruct. Target base: the same model after NeuZip with no mantissa bits kept (k=0,
decoded back to a plain model): every weight rounded to a power of two, a genuinely different model that an
operator might switch to to save memory. Tasks from the packaged data: SMS spam (" yes" / " no": held-out
accuracy, answer by the larger next-token logit) and BBC headlines from an article's opening (held-out loss of
the headline tokens, lower is better). For each task: the source adapter (PiSSA, trained with a discriminator,
on the task's examples less the validation set `adapter train --discriminator` holds out) on the source base;
the target base alone; the source adapter applied unchanged to the target; the Trans-LoRA adapter (its guard
reads that validation set); the same without the discriminator's filter; and an upper bound trained on the
target with the same real data. Then PiSSA, pissa_niter_4 and LoRA trained on the source base with the same rank, steps and learning rate:
their loss curves (PNG + JSON) and held-out metric. Prints tables, writes JSON.
"""

import json
import time
from pathlib import Path

import torch

from serve.adapters.data import PromptExample, TrainExample
from serve.adapters.tasks import heldout_examples, task_examples
from serve.adapters.train import train_adapter
from serve.adapters.load import load_lm
from serve.adapters.translora import (SEEDS, YES, TransferFailed, answer_tokens, next_token_logits,
                                      train_discriminator, transfer)
from serve.adapters.validation import completion_loss, split_examples
from serve.bench.report import finish, machine

TASKS = ("spam", "headlines")
TRAIN, HELDOUT = 128, 100
RANK, STEPS, LR = 8, 48, 5e-4
SAMPLES = 48
INITS = ("pissa", "pissa_niter_4", "lora")


def target_base(work: Path) -> Path:
    """SmolLM2 after NeuZip k=0, as a plain HF directory (built once)."""
    from serve.codecs.neuzip_file import compress_dir, decompress_dir
    from serve.data.models import smollm2_dir

    out = work / "smollm2-k0"
    if not (out / "config.json").exists():
        compress_dir(smollm2_dir(), 0, work / "smollm2-k0.nzp-dir")
        decompress_dir(work / "smollm2-k0.nzp-dir", out)
    return out


@torch.no_grad()
def evaluate(task: str, base: Path, adapter: Path | None, examples: list[PromptExample]) -> dict[str, float]:
    """Held-out metrics: "loss" (mean loss per completion token, both tasks) and, for spam, "accuracy" (the
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


def primary(task: str) -> tuple[str, int]:
    """The metric a task is judged by and its direction (+1: higher is better)."""
    return ("accuracy", 1) if task == "spam" else ("loss", -1)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _train(base: Path, examples: list[TrainExample], out: Path, init: str) -> None:
    if not out.exists():
        _log(f"training {out.name} ({init}, rank {RANK}, {STEPS} steps)")
        train_adapter(base, examples, out, init=init, rank=RANK, steps=STEPS, lr=LR, progress=lambda *_: None)


ROWS = ("source adapter on the source base", "target base alone", "source adapter unchanged on the target",
        "Trans-LoRA", "Trans-LoRA, no filter", "upper bound: trained on the target with the real data")


def transfer_table(work: Path, source: Path, target: Path) -> dict:
    out = {}
    for task in TASKS:
        train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
        seeds, _, rest = split_examples(train, SEEDS)  # as `adapter train --discriminator`: nobody trains on
        src = work / f"{task}-source-heldout"  # the validation set the transfer's guard reads
        _train(source, seeds + rest, src, "pissa")
        if not (src / "translora").exists():
            _log(f"training {task}'s discriminator")
            train_discriminator(source, src, train, task, seeds=SEEDS)
        _train(target, seeds + rest, work / f"{task}-target-real-heldout", "pissa")
        reports, failures = {}, {}
        for name, use_filter in (("Trans-LoRA", True), ("Trans-LoRA, no filter", False)):
            moved = work / f"{task}-{'filtered' if use_filter else 'unfiltered'}-heldout"
            if not moved.exists():
                _log(f"{task}: {name}, {SAMPLES} synthetic inputs")
                try:
                    transfer(source, src, target, moved, samples=SAMPLES, use_filter=use_filter, rank=RANK,
                             steps=STEPS, lr=LR)
                except TransferFailed as e:
                    failures[name] = str(e)
                    continue
            reports[name] = json.loads((moved / "translora_report.json").read_text())
        _log(f"{task}: evaluating on {len(held)} held-out examples")
        moved = {f: work / f"{task}-{f}-heldout" for f in ("filtered", "unfiltered", "target-real")}
        runs = dict(zip(ROWS, ((source, src), (target, None), (target, src), (target, moved["filtered"]),
                               (target, moved["unfiltered"]), (target, moved["target-real"]))))
        rows = {name: None if name in failures else evaluate(task, base, adapter, held)
                for name, (base, adapter) in runs.items()}
        out[task] = {"metric": primary(task)[0], "heldout": len(held), "rows": rows, "reports": reports,
                     "failures": failures, "verdicts": transfer_verdicts(task, rows)}
    return out


def transfer_verdicts(task: str, rows: dict[str, dict[str, float] | None]) -> dict[str, bool]:
    """The claims Trans-LoRA makes, each checked on the task's metric (a transfer that made no adapter beats
    nothing)."""
    metric, sign = primary(task)

    def beats(a: str, b: str) -> bool:
        return rows[a] is not None and (rows[b] is None or sign * rows[a][metric] > sign * rows[b][metric])

    return {"Trans-LoRA beats the target base alone": beats("Trans-LoRA", "target base alone"),
            "Trans-LoRA beats the source adapter unchanged on the target":
                beats("Trans-LoRA", "source adapter unchanged on the target"),
            "the discriminator's filter beats no filter": beats("Trans-LoRA", "Trans-LoRA, no filter")}


def init_table(work: Path, source: Path) -> dict:
    out = {}
    for task in TASKS:
        train, held = task_examples(task, "train", TRAIN), heldout_examples(task, HELDOUT)
        runs = {}
        for init in INITS:
            d = work / f"{task}-init-{init}"
            _train(source, train, d, init)
            log = json.loads((d / "train_log.json").read_text())
            runs[init] = {"losses": [e["loss"] for e in log["log"]], "heldout": evaluate(task, source, d, held),
                          "train_seconds": log["seconds"], "init_seconds": log["init_seconds"]}
        out[task] = {"runs": runs, "verdicts": init_verdicts(runs)}
    return out


def plot(inits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(inits), figsize=(5 * len(inits), 3.5))
    for ax, (task, t) in zip(axes, inits.items()):
        for init, r in t["runs"].items():
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=init)
        ax.set_title(f"{task}: training loss, rank {RANK}, lr {LR}")
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_translora_bench(out: Path, work: Path | None = None) -> dict:
    from serve.data.cache import home
    from serve.data.models import smollm2_dir

    work = work or home() / "bench-translora"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source, target = smollm2_dir(), target_base(work)
    report = {"machine": machine(), "source": "SmolLM2-135M-Instruct", "target": "SmolLM2-135M-Instruct after NeuZip k=0",
              "rank": RANK, "steps": STEPS, "lr": LR, "train_examples": TRAIN, "samples": SAMPLES,
              "transfer": transfer_table(work, source, target), "inits": init_table(work, source)}
    report["seconds"] = time.perf_counter() - t0
    finish(report, out, print_report)
    plot(report["inits"], out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return report


def window_means(losses: list[float], width: int = 8) -> list[float]:
    """Mean training loss over consecutive windows of steps (a batch of 4 makes single steps noisy)."""
    return [sum(losses[i:i + width]) / len(losses[i:i + width]) for i in range(0, len(losses), width)]


def init_verdicts(runs: dict) -> dict[str, bool]:
    """PiSSA's claim against LoRA's: lower training loss early (faster convergence) and lower held-out loss."""
    half = STEPS // 2
    early = {init: sum(x["losses"][:half]) / half for init, x in runs.items()}
    return {"PiSSA's training loss over the first half is below LoRA's": early["pissa"] < early["lora"],
            "PiSSA's held-out loss is below LoRA's": runs["pissa"]["heldout"]["loss"] < runs["lora"]["heldout"]["loss"]}


def print_report(r: dict) -> None:
    print(f"\nTrans-LoRA on {r['machine']}: {r['source']} -> {r['target']}; adapters rank {r['rank']}, "
          f"{r['steps']} steps, lr {r['lr']}; {r['train_examples']} real training examples per task, "
          f"{r['samples']} synthetic inputs per transfer")
    tasks = r["transfer"]
    cols = [(task, m) for task, t in tasks.items() for m in (("accuracy", "loss") if t["metric"] == "accuracy"
                                                              else ("loss",))]
    sizes = ", ".join(f"{k} {t['heldout']}" for k, t in tasks.items())
    print(f"\nheld-out ({sizes} examples; loss per completion token)")
    print(f"{'':<56}" + "".join(f"{task + ' ' + m:>18}" for task, m in cols))
    for row in ROWS:
        cells = [tasks[task]["rows"][row] for task, _ in cols]
        print(f"{row:<56}" + "".join(f"{c[m]:>18.3f}" if c else f"{'no adapter':>18}" for c, (_, m) in zip(cells, cols)))
    for task, t in tasks.items():
        for name, rep in t["reports"].items():
            secs = ", ".join(f"{k} {v:.0f} s" for k, v in rep["seconds"].items())
            print(f"{task}, {name}: {rep['accepted']} of {rep['attempts']} generated inputs kept ({secs})")
        for name, why in t["failures"].items():
            print(f"{task}, {name}: no adapter: {why}")
        for claim, holds in t["verdicts"].items():
            print(f"{task} ({t['metric']}): {claim}: {'yes' if holds else 'NO'}")
    print(f"\nPiSSA against LoRA on the source base: rank {r['rank']}, {r['steps']} steps, lr {r['lr']}, the same "
          f"data and seed; training loss as means over 8-step windows")
    for task, t in r["inits"].items():
        for init, x in t["runs"].items():
            curve = " ".join(f"{v:.3f}" for v in window_means(x["losses"]))
            held = ", ".join(f"{k} {v:.3f}" for k, v in x["heldout"].items())
            print(f"{task:<10}{init:<15}train {curve}   held-out {held}")
        for claim, holds in t["verdicts"].items():
            print(f"{task}: {claim}: {'yes' if holds else 'NO'}")
