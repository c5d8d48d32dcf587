"""The synthetic inputs measured per target (issue 50): per cell, the transfer as it is now (a student on the
inputs the discriminator kept and, where it refused a quarter or more, one on the inputs as written, the better on
validation kept) beside the transfer with the filter's inputs only (the same seed, so the same inputs written),
from `manyfold bench translora --out` parts and the work dir their transfers are kept in:

    python bench-results/translora-50/inputs_table.py --work DIR PART.json [PART.json ...]
"""

import argparse
import json
from pathlib import Path

from serve.adapters.students import KEPT, WRITTEN
from serve.adapters.translora import REPORT_FILE
from serve.bench.translora import TRANSFER_DIRS
from serve.bench.translora_table import FILTERED, MOVED

SLUG = {row: TRANSFER_DIRS[row] for row in (MOVED, FILTERED)}


def validation(s: dict) -> str:
    return f"{s['loss']:.3f}" + ("" if s["accuracy"] is None else f" ({s['accuracy']:.2f})")


def rows(work: Path, part: dict):
    for target, tasks in part["transfer"].items():
        for task, t in tasks.items():
            metric = t["metric"]
            for i, seed in enumerate(t["seeds"]):
                reports = {row: json.loads((work / f"{target}-{task}-s{seed}-{SLUG[row]}" / REPORT_FILE).read_text())
                           for row in SLUG}
                inputs = reports[MOVED]["inputs"]
                sets = inputs["sets"]
                held = {row: t["runs"][row][i] for row in SLUG}
                gaps = {row: t["gaps"].get(row, {}).get("gap") for row in SLUG}
                yield (f"{target} {task} ({seed})", f"{reports[MOVED]['generation']['acceptance_rate']:.0%}",
                       f"{reports[MOVED]['accepted']}/{reports[MOVED]['attempts']}",
                       f"{reports[FILTERED]['accepted']}/{reports[FILTERED]['attempts']}",
                       "written" if inputs["chosen"] == WRITTEN else "kept",
                       " / ".join(validation(sets[k]) for k in (KEPT, WRITTEN) if k in sets),
                       " / ".join("refused" if held[r] is None else f"{held[r][metric]:.3f}" for r in SLUG),
                       " / ".join("-" if g is None else f"{g['mean']:.0%}" for g in gaps.values()),
                       " / ".join(f"{sum(reports[r]['seconds'].values()) / 60:.1f}" for r in SLUG))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("parts", nargs="+")
    args = p.parse_args()
    head = ("cell (seed)", "passed", "kept/written", "filter only", "chosen", "validation: kept / as written",
            "held-out: now / filter only", "gap: now / filter only", "minutes: now / filter only")
    table = [head] + [r for part in args.parts for r in rows(Path(args.work), json.loads(Path(part).read_text()))]
    widths = [max(len(r[c]) for r in table) for c in range(len(head))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
