"""The benchmarks' machine figures: the CPU time a virtual machine's hypervisor gave to other guests."""

from pathlib import Path

from serve.bench.report import cpu_times, stolen_share


def _stat(path: Path, user: int, system: int, idle: int, steal: int) -> dict[str, int] | None:
    line = f"{user} 0 {system} {idle} 0 0 0 {steal} 0 0"
    path.write_text(f"cpu  {line}\ncpu0 {line}\n")
    return cpu_times(path)


def test_the_share_stolen_is_the_steal_ticks_over_every_tick_between_two_readings(tmp_path):
    before = _stat(tmp_path / "stat", user=100, system=50, idle=800, steal=50)
    after = _stat(tmp_path / "stat", user=400, system=100, idle=1200, steal=300)
    assert before["steal"] == 50 and after["user"] == 400
    assert stolen_share(before, after) == round(250 / (300 + 50 + 400 + 250), 4)
    assert stolen_share(after, after) is None  # no time passed: no figure, not 0


def test_a_machine_without_proc_stat_gives_no_figure(tmp_path):
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert cpu_times(tmp_path / "missing") is None and cpu_times(tmp_path / "stat") is None
    assert stolen_share(None, None) is None
