"""Trans-LoRA on a GPU (skipped without one): the teacher's writing, the discriminator, the student and the
guard's comparison all run on CUDA with the base in bf16, and the transfer writes an adapter that loads."""

import pytest
import torch

from serve.adapters import candidates, distill, load, student_start, transfer_guard, translora

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_a_transfer_runs_every_model_on_the_gpu_in_bf16(bases, source_adapter, tmp_path, monkeypatch,
                                                        any_student_passes):
    placed = []
    real = load.load_lm

    def spying(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        placed.append((model.device.type, next(model.parameters()).dtype))
        return model, tok

    for module in (load, translora, candidates, distill, student_start, transfer_guard):
        monkeypatch.setattr(module, "load_lm", spying)
    report = translora.transfer(bases[0], source_adapter, bases[0], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=3)
    assert placed and all(device == "cuda" for device, _ in placed)
    assert ("cuda", torch.bfloat16) in placed
    assert report.accepted >= 1 and (tmp_path / "moved" / "adapter_config.json").is_file()
