"""PEFT adapter directories: strict reading, atomic writing, and the exact PiSSA -> LoRA conversion.

A trained PiSSA adapter is relative to its residual base W_res = W - s B0 A0; the server holds W only, so
it serves the converted rank-2r LoRA, which is relative to W (what peft's `subtract_mutated_init` writes).
"""

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from serve.errors import ArtifactError, VariantIncompatible
from serve.store.writer import atomic_dir
from serve.variants.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_raw_pissa,
    read_peft_adapter,
)

SAME_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
               "fan_in_fan_out")
"""Config fields a trained adapter and its initial adapter must share."""


def write_adapter(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write a PEFT adapter directory atomically, in the layout `PeftModel.from_pretrained` reads."""
    with atomic_dir(out_dir) as stage:
        save_file({k: v.contiguous() for k, v in tensors.items()}, stage / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (stage / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return Path(out_dir)


def converted_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the rank-2r LoRA: every rank doubled, every scale s kept.

    s = alpha / r doubles alpha; with rslora s = alpha / sqrt(r) multiplies it by sqrt(2), as peft does.
    peft refuses rank_pattern / alpha_pattern with rslora; here the same rule covers the patterns too.
    """
    factor = math.sqrt(2) if config.get("use_rslora") else 2
    out = dict(config)
    out["r"] = 2 * config["r"]
    out["lora_alpha"] = config["lora_alpha"] * factor
    out["rank_pattern"] = {k: 2 * v for k, v in (config.get("rank_pattern") or {}).items()}
    out["alpha_pattern"] = {k: v * factor for k, v in (config.get("alpha_pattern") or {}).items()}
    out["init_lora_weights"] = True
    out["inference_mode"] = True
    return out


def _same(field: str, a: Any, b: Any) -> bool:
    if field == "target_modules" and isinstance(a, list) and isinstance(b, list):
        return sorted(a) == sorted(b)  # peft saves a set as a list, in no fixed order
    return a == b


def check_pair(trained_dir: Path, trained_cfg: dict[str, Any], trained: dict[str, torch.Tensor],
               initial_dir: Path, initial_cfg: dict[str, Any], initial: dict[str, torch.Tensor]) -> None:
    """Both adapters must come from one PiSSA init: same config fields, same LoRA tensors and shapes."""
    if not isinstance(trained_cfg.get("r"), int) or not isinstance(trained_cfg.get("lora_alpha"), (int, float)):
        raise ArtifactError(f"{trained_dir / ADAPTER_CONFIG}: r and lora_alpha must be numbers")
    if not is_raw_pissa(trained_cfg):
        raise VariantIncompatible(f"{trained_dir / ADAPTER_CONFIG}: init_lora_weights is "
                                  f"{trained_cfg.get('init_lora_weights')!r}, not a raw PiSSA adapter")
    if trained_cfg.get("use_dora") or trained_cfg.get("lora_bias"):
        raise VariantIncompatible(f"{trained_dir / ADAPTER_CONFIG}: DoRA / lora_bias adapters are not a rank-2r LoRA")
    init = initial_cfg.get("init_lora_weights")
    if init is not True and init != trained_cfg["init_lora_weights"]:
        raise VariantIncompatible(f"{initial_dir / ADAPTER_CONFIG}: init_lora_weights is {init!r}; "
                                  f"the trained adapter used {trained_cfg['init_lora_weights']!r}")
    for field in SAME_FIELDS:
        if not _same(field, trained_cfg.get(field), initial_cfg.get(field)):
            raise VariantIncompatible(f"{initial_dir / ADAPTER_CONFIG}: {field} is {initial_cfg.get(field)!r}; "
                                      f"the trained adapter has {trained_cfg.get(field)!r}")
    for name, t in trained.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            raise VariantIncompatible(f"{trained_dir / ADAPTER_WEIGHTS}: tensor {name} is not a LoRA A or B")
        if name not in initial or (initial[name].shape, initial[name].dtype) != (t.shape, t.dtype):
            found = f"{initial[name].dtype} {tuple(initial[name].shape)}" if name in initial else "missing"
            raise VariantIncompatible(f"{initial_dir / ADAPTER_WEIGHTS}: tensor {name} is {found}; "
                                      f"the trained adapter has {t.dtype} {tuple(t.shape)}")
    if extra := sorted(set(initial) - set(trained)):
        raise VariantIncompatible(f"{initial_dir / ADAPTER_WEIGHTS}: tensor {extra[0]} is not in the trained adapter")


def convert_pissa(trained_dir: str | Path, initial_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the trained PiSSA adapter as a plain rank-2r LoRA on the original base W.

    W = W_res + s B0 A0 (init) and W_res + s B1 A1 (trained) give ΔW = s (B1 A1 - B0 A0)
    = s [B1 | -B0] [A1 ; A0], so A' = cat([A1, A0], dim=0) [2r, in] and B' = cat([B1, -B0], dim=1) [out, 2r].
    The tensors equal peft's `save_pretrained(..., path_initial_model_for_weight_conversion=initial_dir)`.
    """
    trained_dir, initial_dir = Path(trained_dir), Path(initial_dir)
    trained_cfg, trained = read_peft_adapter(trained_dir)
    initial_cfg, initial = read_peft_adapter(initial_dir)
    check_pair(trained_dir, trained_cfg, trained, initial_dir, initial_cfg, initial)
    tensors = {}
    for name, t in trained.items():
        if ".lora_A." in name:
            tensors[name] = torch.cat([t, initial[name]], dim=0)  # [2r, in]
        else:
            tensors[name] = torch.cat([t, -initial[name]], dim=1)  # [out, 2r]
    return write_adapter(out_dir, converted_config(trained_cfg), tensors)
