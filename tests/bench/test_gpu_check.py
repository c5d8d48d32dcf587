"""The GPU check's CPU half: every module a lent GPU session imports imports with only the device image's packages
and the wheels it carries (anything else refused, as there), and every phase runs on tiny shapes with the torch
twins and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from serve.bench import gpu_check


def test_every_module_the_gpu_run_imports_imports_with_the_images_packages_and_the_wheels_alone():
    assert gpu_check.image_imports() == []


def test_a_package_neither_on_the_image_nor_carried_is_refused():
    allowed = gpu_check.allowed() - {"obstore"}
    run = subprocess.run([sys.executable, "-c", gpu_check.IMAGE_IMPORTS, ",".join(sorted(allowed)),
                          "serve.store.objects"], capture_output=True, text=True,
                         cwd=Path(gpu_check.__file__).parents[2])
    assert run.returncode == 1 and "No module named 'obstore' (not on the device's image nor in WHEELS)" in run.stdout


def test_the_cpu_half_runs_every_phase_and_writes_what_finished(tmp_path):
    report = gpu_check.run(tmp_path / "out", tmp_path / "work", 600.0, torch.device("cpu"))
    written = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert written["phases"].keys() == set(gpu_check.PHASES)
    assert "skipped" in written["phases"]["cuda_tests"]
    for name in ("imports", "paged_decode", "engine_steps", "logprobs"):
        assert "result" in written["phases"][name], (name, written["phases"][name])
    decode = report["phases"]["paged_decode"]["result"]
    assert decode["blocks_16_ms"] > 0 and decode["one_block_a_row_ms"] > 0
    assert report["phases"]["engine_steps"]["result"][0]["engine_kinds_ms"] > 0
    assert report["phases"]["logprobs"]["result"]["passed"]
