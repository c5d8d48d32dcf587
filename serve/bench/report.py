"""What every benchmark shares: the machine it ran on, a median timer, and writing its JSON once printed."""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

NO_GPU = "not measured: no GPU was lent to this run (the Triton kernel is checked under TRITON_INTERPRET=1)"


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}, CPU only"


def median_time(fn: Callable[[], object], repeats: int, warmup: bool = False) -> float:
    """Median seconds of `repeats` calls of fn (after one untimed call with warmup)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def finish(report: dict, out: Path, print_report: Callable[[dict], None]) -> dict:
    """Print the report's tables, then write it as JSON to out."""
    print_report(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
