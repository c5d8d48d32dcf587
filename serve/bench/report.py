"""What every benchmark shares: the machine it ran on, a median timer, and writing its JSON once printed."""

import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: Path = Path("/proc/stat")) -> dict[str, int] | None:
    """The machine's CPU time so far by state, in clock ticks (Linux's /proc/stat, its first line); None where
    there is none to read."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 1 + len(CPU_STATES) or fields[0] != "cpu":
        return None
    return dict(zip(CPU_STATES, map(int, fields[1:1 + len(CPU_STATES)])))


def stolen_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """The share of the CPU time between two cpu_times() readings that the hypervisor gave to other guests (steal):
    a virtual machine runs that much slower, and a load near its saturation far more so (the fairness scenario's
    light tenants alone: 266 ms a step, then 510 ms 40 minutes later on the same arrivals, while 13% was stolen)."""
    if before is None or after is None:
        return None
    total = sum(after[k] - before[k] for k in CPU_STATES)
    return round((after["steal"] - before["steal"]) / total, 4) if total > 0 else None


def sync(device: "torch.device") -> None:
    """Wait for a CUDA device's queued work (timings read after it); nothing on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


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


def descendants(root_pid: int) -> set[int]:
    """Every process below root_pid, read from /proc (a server's Ray GCS, raylet, workers, Serve replicas)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    below, frontier = set(), {root_pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return below


def process_tree_rss(root_pid: int) -> dict[int, tuple[str, int]]:
    """pid -> (command line, RSS bytes) of every process below root_pid, read from /proc: a server that starts
    its workers as children is measured without psutil."""
    out = {}
    for pid in descendants(root_pid):
        try:  # statm's second field: resident pages
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[pid] = (cmd, int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, IndexError, ValueError):
            pass  # gone since
    return out


def percentile(values: list[float], p: float) -> float:
    """The value below which a share p of `values` lies (nearest rank); nan for none."""
    v = sorted(values)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


class Sampler:
    """Calls fn every every_s seconds in a daemon thread, from its creation until stop() (which takes one last
    sample), keeping {"t_s": seconds since creation, **fn()}: a quantity over the time a benchmark runs."""

    def __init__(self, fn: Callable[[], dict], every_s: float):
        self.fn, self.every_s, self.samples = fn, every_s, []
        self.t0, self._stop = time.perf_counter(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s if self.samples else 0.0):
            self.samples.append({"t_s": time.perf_counter() - self.t0, **self.fn()})
        self.samples.append({"t_s": time.perf_counter() - self.t0, **self.fn()})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
