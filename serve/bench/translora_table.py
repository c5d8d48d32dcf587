"""The Trans-LoRA bench's figures over seeds: per row a mean and a spread (min..max over the seeds), the plain
verdicts drawn from them, and the tables printed from the bench's JSON (serve/bench/translora.py runs it).

A row beats another by more than the spread when the gap between their means, in the metric's good direction,
exceeds the larger of their two spreads (max - min over seeds); within it they match. A row with a seed that
made no adapter (the guard refused it, or too few inputs were kept) beats nothing.
"""

import statistics
from pathlib import Path

from serve.adapters.tasks import LABEL_TASKS

ROWS = ("source adapter on the source base", "target base alone", "source adapter unchanged on the target",
        "Trans-LoRA", "Trans-LoRA's student, whichever the guard kept", "Trans-LoRA, the filter's inputs only",
        "Trans-LoRA, no filter", "upper bound: trained on the target with the real data")
ALONE, UNCHANGED, MOVED, STUDENT, FILTERED, UNFILTERED, UPPER = ROWS[1:]
"""MOVED is what the transfer registers (the student, or the source adapter unchanged where the guard keeps it);
STUDENT the student it trained, kept or not; FILTERED the transfer with one student, on the inputs the
discriminator kept (what MOVED was in reports written before the inputs were measured, serve/adapters/students.py);
UNFILTERED the transfer without the discriminator."""
TRANSFERS = (MOVED, FILTERED, UNFILTERED)
"""The rows that run a transfer of their own, each with its report."""
TUNED = ("spam", "headlines", "tweets")
"""Tasks the transfer's defaults were chosen on (the ablations of issues 22 and 36 ran on them)."""
HELD_OUT = ("topics", "sentiment")
"""Tasks no default was chosen on, in a table apart: what a tenant's task the project never saw would get. Their
texts are not new (BBC articles as headlines', tweets as tweets'), the tasks are: labels of 5 and 3 kinds."""
Run = dict[str, float] | None
"""One seed's held-out metrics of a row; None where that seed made no adapter."""


def primary(task: str) -> tuple[str, int]:
    """The metric a task is judged by and its direction (+1: higher is better)."""
    return ("accuracy", 1) if task in LABEL_TASKS else ("loss", -1)


def summarize(runs: list[Run]) -> dict:
    """Per metric over the seeds that made an adapter: mean, min and max; with how many seeds ran and how many
    made no adapter."""
    done = [r for r in runs if r is not None]
    out: dict = {"seeds": len(runs), "missing": len(runs) - len(done)}
    for metric in done[0] if done else ():
        values = [r[metric] for r in done]
        out[metric] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


def spread(s: dict, metric: str) -> float:
    return s[metric]["max"] - s[metric]["min"]


def versus(a: dict, b: dict, metric: str, sign: int) -> str:
    """How row a stands against row b: "beats" or "falls short of" by more than the spread, "matches" within
    it, or "no adapter" where a seed of a made none (b missing too: "no adapter" as well)."""
    if a["missing"] or metric not in a or b["missing"] or metric not in b:
        return "no adapter"
    gap = sign * (a[metric]["mean"] - b[metric]["mean"])
    margin = max(spread(a, metric), spread(b, metric))
    return "beats" if gap > margin else "falls short of" if gap < -margin else "matches"


def gaps_recovered(task: str, runs: dict[str, list[Run]]) -> dict[str, dict]:
    """The headline: per row that moves the adapter (Trans-LoRA, without the filter, the source adapter
    unchanged), the share of the gap between the target alone and the upper bound (trained on the target with the
    real data) that it closes on the task's metric, seed by seed (the seed's own upper bound), summarized; 1.0 is
    as good as training on the target with the real data, 0 no better than the target alone."""
    metric, _ = primary(task)
    alone = runs[ALONE][0][metric]
    out = {}
    for row in (MOVED, STUDENT, FILTERED, UNFILTERED, UNCHANGED):
        if row in runs and UPPER in runs:
            out[row] = summarize([None if r is None or u is None or u[metric] == alone else
                                  {"gap": (r[metric] - alone) / (u[metric] - alone)}
                                  for r, u in zip(runs[row], runs[UPPER])])
    return out


def gap_line(task: str, gaps: dict[str, dict]) -> str:
    """"task: gap recovered: Trans-LoRA 76% (70..81%), ...", each row's mean (min..max) over seeds."""
    def pct(s: dict) -> str:
        if "gap" not in s:
            return "no adapter"
        g = s["gap"]
        missing = f" [{s['seeds'] - s['missing']}/{s['seeds']}]" if s["missing"] else ""
        return f"{g['mean']:.0%} ({g['min']:.0%}..{g['max']:.0%}){missing}"

    names = {MOVED: "Trans-LoRA", STUDENT: "its student", FILTERED: "the filter's inputs only", UNFILTERED: "no filter",
             UNCHANGED: "the source adapter unchanged"}
    return f"{task}: gap recovered: " + ", ".join(f"{names[row]} {pct(s)}" for row, s in gaps.items())


AGAINST = {ALONE: "the target base alone", UNCHANGED: "the source adapter applied unchanged",
           FILTERED: "itself taught on the filter's inputs only",
           UNFILTERED: "itself without the discriminator's filter"}
"""The rows Trans-LoRA is judged against, as the statements name them."""


def task_verdicts(task: str, rows: dict[str, dict]) -> dict[str, str]:
    """Trans-LoRA against each row of AGAINST that ran, on the task's metric (versus), keyed by that row."""
    metric, sign = primary(task)
    return {row: versus(rows[MOVED], rows[row], metric, sign) for row in AGAINST if row in rows}


def cell(s: dict | None, metric: str) -> str:
    """"mean (min..max)"; one run: its value alone; "[k/n]" where only k of n seeds made an adapter."""
    if s is None or metric not in s:
        return "no adapter"
    m = s[metric]
    text = f"{m['mean']:.3f}" if m["min"] == m["max"] and s["seeds"] - s["missing"] == 1 else \
        f"{m['mean']:.3f} ({m['min']:.3f}..{m['max']:.3f})"
    return text + (f" [{s['seeds'] - s['missing']}/{s['seeds']}]" if s["missing"] else "")


SENTENCES = {"beats": "beats {} by more than the spread over seeds",
             "matches": "matches {} (within the spread over seeds)",
             "falls short of": "falls short of {} by more than the spread over seeds",
             "no adapter": "is not judged against {}: a seed made no adapter"}


def statement(task: str, verdicts: dict[str, str], rows: dict[str, dict]) -> list[str]:
    """The verdicts as plain sentences with their figures."""
    metric, _ = primary(task)
    return [f"{task} ({metric}): Trans-LoRA {SENTENCES[word].format(AGAINST[row])}: "
            f"{cell(rows[MOVED], metric)} against {cell(rows[row], metric)}" for row, word in verdicts.items()]


def print_transfer(target: str, info: dict, tasks: dict, which: str = "") -> None:
    """One target's table (rows x task metrics, mean (min..max) over seeds) and its statements."""
    print(f"\ntarget {target}{f' ({which})' if which else ''}: {info['description']}")
    if "perplexity" in info:
        shift = ", ".join(f"{c} {b:.2f} -> {info['perplexity']['after'][c]:.2f}"
                          for c, b in info["perplexity"]["before"].items())
        print(f"held-out perplexity, source -> this target: {shift}")
    cols = [(task, m) for task, t in tasks.items() for m in (("accuracy", "loss") if t["metric"] == "accuracy"
                                                              else ("loss",))]
    sizes = ", ".join(f"{k} {t['heldout']}" for k, t in tasks.items())
    print(f"held-out ({sizes} examples; loss per completion token; mean (min..max) over seeds)")
    print(f"{'':<56}" + "".join(f"{task + ' ' + m:>30}" for task, m in cols))
    for row in (r for r in ROWS if any(r in t["rows"] for t in tasks.values())):
        print(f"{row:<56}" + "".join(f"{cell(tasks[task]['rows'].get(row), m):>30}" for task, m in cols))
    for task, t in tasks.items():
        for name, reports in t["reports"].items():
            kept = ", ".join("-" if r is None else f"{r['accepted']}/{r['attempts']}" + student(r) for r in reports)
            print(f"{task}, {name}: inputs kept of generated, per seed: {kept}")
        for name, whys in t["failures"].items():
            for seed, why in whys.items():
                print(f"{task}, {name}, seed {seed}: no adapter: {why}")
        if "gaps" in t:
            print(gap_line(task, t["gaps"]))
        for line in statement(task, t["verdicts"], t["rows"]):
            print(line)


def student(report: dict) -> str:
    """How a seed's student trained, where its report says: " (N steps at LR, best at step B, M min, kept: K)"."""
    if "steps" not in report:
        return ""
    minutes = f", {sum(report['seconds'].values()) / 60:.1f} min" if "seconds" in report else ""
    kept = f", kept: {report['kept']}" if "kept" in report else ""
    taught = f", taught on the inputs {report['chosen']}" if report.get("chosen") else ""
    return (f" ({report['steps']} steps at {report['lr']:.1e}, best at step {report['best_step']}{minutes}{kept}"
            f"{taught})")


def window_means(losses: list[float], width: int = 8) -> list[float]:
    """Mean training loss over consecutive windows of steps (a batch of 4 makes single steps noisy)."""
    return [sum(losses[i:i + width]) / len(losses[i:i + width]) for i in range(0, len(losses), width)]


def mean_curve(curves: list[list[float]]) -> list[float]:
    """Step by step mean of equal-length loss curves (one per seed)."""
    return [statistics.fmean(step) for step in zip(*curves)]


def init_verdicts(runs: dict, steps: int) -> dict[str, str]:
    """PiSSA's claims against LoRA's: lower training loss over the first half (means over seeds), and a lower
    held-out loss by more than the spread."""
    half = steps // 2
    early = {init: statistics.fmean(x["curve"][:half]) for init, x in runs.items()}
    return {"PiSSA's training loss over the first half against LoRA's":
                "below" if early["pissa"] < early["lora"] else "not below",
            "PiSSA's held-out loss against LoRA's": versus(runs["pissa"]["heldout"], runs["lora"]["heldout"],
                                                           "loss", -1)}


def print_inits(r: dict) -> None:
    print(f"\nPiSSA against LoRA on the source base: rank {r['rank']}, {r['steps']} steps, lr {r['lr']}, the same "
          f"data, seeds {', '.join(map(str, r['seeds']))}; training loss as means over seeds and 8-step windows; "
          f"held-out mean (min..max)")
    for task, t in r["inits"].items():
        for init, x in t["runs"].items():
            curve = " ".join(f"{v:.3f}" for v in window_means(x["curve"]))
            held = ", ".join(f"{m} {cell(x['heldout'], m)}" for m in x["heldout"] if m not in ("seeds", "missing"))
            print(f"{task:<10}{init:<15}train {curve}   held-out {held}")
        for claim, word in t["verdicts"].items():
            print(f"{task}: {claim}: {word}")


def print_report(r: dict) -> None:
    print(f"\nTrans-LoRA on {r['machine']}: source {r['source']}; adapters rank {r['rank']}, {r['steps']} steps, "
          f"lr {r['lr']} (students: transfer's defaults, early stopping on the validation set); "
          f"{r['train_examples']} real training examples per task, up to {r['samples']} synthetic inputs per transfer "
          f"(as many as its source adapter trained on); "
          f"seeds {', '.join(map(str, r['seeds']))}")
    for target, tasks in r["transfer"].items():
        tuned = {k: t for k, t in tasks.items() if k not in HELD_OUT}
        held = {k: t for k, t in tasks.items() if k in HELD_OUT}
        if tuned:
            print_transfer(target, r["targets"][target], tuned)
        if held:
            print_transfer(target, r["targets"][target], held, "tasks no default was chosen on")
    if r.get("inits"):
        print_inits(r)


def plot(inits: dict, rank: int, lr: float, path: Path) -> None:
    """Each task's training loss per init (mean over seeds), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(inits), figsize=(5 * len(inits), 3.5), squeeze=False)
    for ax, (task, t) in zip(axes[0], inits.items()):
        for init, r in t["runs"].items():
            ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=init)
        ax.set_title(f"{task}: training loss, rank {rank}, lr {lr}")
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
