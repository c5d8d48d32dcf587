"""A full fine-tune's delta cut to rank r: a PEFT LoRA adapter the store serves as kind "lora".

Each matmul weight the fine-tune changed (Linear, or GPT-2's Conv1D) is factored once by SVD, delta = U S V^T;
rank r keeps B = U_r S_r and A = V_r^T (lora_alpha = r, so PEFT's scale is 1). The classifier head is kept whole
through modules_to_save. Every other changed tensor (embeddings, norms, biases) cannot ride on a LoRA: it is
left at the base's value and named in `dropped`, and the measured agreement says what that cost. This is the
method of mergekit-extract-lora (a truncated SVD per linear delta, the rest kept or dropped).
"""

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serve.codecs.fmdelta_file import match_base_name
from serve.errors import VariantIncompatible
from serve.store.model_dir import is_causal_lm
from serve.store.tensors import SafetensorsSource, save_tensors
from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, HEAD_MODULES, LABELS_CONFIG, matmul_dims

_PREFIX = "base_model.model."


@dataclass
class DeltaFactors:
    """The fine-tune's delta in the parts a LoRA can carry, factored once and cut at any rank."""

    us: dict[str, torch.Tensor] = field(default_factory=dict)
    """Module -> U S, [out, k] (singular values descending)."""
    vh: dict[str, torch.Tensor] = field(default_factory=dict)
    """Module -> V^T, [k, in]."""
    head: dict[str, torch.Tensor] = field(default_factory=dict)
    """The classifier head's tensors under their fine-tune names ("classifier.weight")."""
    dropped: list[str] = field(default_factory=list)
    """Changed tensors no LoRA carries: served at the base's value."""
    fan_in_fan_out: bool = False
    dtype: torch.dtype = torch.float32
    task_type: str = "CAUSAL_LM"

    def rank_of(self, module: str, rank: int) -> int:
        return min(rank, self.vh[module].shape[0])

    def nbytes(self, rank: int) -> int:
        """Bytes of the rank-r adapter: its A and B in the fine-tune's dtype, and the head."""
        size = torch.empty((), dtype=self.dtype).element_size()
        ab = sum(self.rank_of(m, rank) * (us.shape[0] + self.vh[m].shape[1]) for m, us in self.us.items())
        return ab * size + sum(t.numel() * t.element_size() for t in self.head.values())

    def max_rank(self) -> int:
        return max((v.shape[0] for v in self.vh.values()), default=0)

    def correction(self, module: str, rank: int) -> torch.Tensor:
        """B A of the rank-r adapter for one module, in the weight's own layout (Conv1D's is [in, out])."""
        r = self.rank_of(module, rank)
        delta = self.us[module][:, :r] @ self.vh[module][:r]
        return delta.T if self.fan_in_fan_out else delta


def matmul_modules(finetuned: Path) -> dict[str, torch.nn.Module]:
    """Module name -> module for every matmul layer of the fine-tune's architecture, built on the meta device
    (no weights read): which weights an adapter can target is a question of module type, not of shape."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(finetuned)
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise VariantIncompatible(f"{finetuned}: architecture {arch!r} is not one transformers builds")
    with torch.device("meta"):
        model = cls(config)
    return {name: m for name, m in model.named_modules() if matmul_dims(m) is not None}


def factor_delta(base_dir: Path, finetuned: Path) -> DeltaFactors:
    """SVD of every matmul weight the fine-tune changed against the base; its head kept; the rest dropped."""
    base, fine = SafetensorsSource(base_dir), SafetensorsSource(finetuned)
    modules = matmul_modules(finetuned)
    names = set(base)
    out = DeltaFactors()
    for name in sorted(fine):
        t = fine[name]
        module = name.rsplit(".", 1)[0]
        if name.split(".", 1)[0] in HEAD_MODULES:
            out.head[name] = t
            continue
        target = match_base_name(name, names)
        if target is None:
            raise VariantIncompatible(f"{finetuned}: tensor '{name}' matches nothing in the base at {base_dir}")
        b = base[target]
        if t.shape != b.shape:
            raise VariantIncompatible(f"{finetuned}: tensor '{name}' is {list(t.shape)}, the base's {list(b.shape)}")
        if torch.equal(t, b):
            continue
        if module in modules and name.endswith(".weight") and t.dim() == 2:
            out.fan_in_fan_out = type(modules[module]).__name__ == "Conv1D"
            delta = (t.double() - b.double()).T if out.fan_in_fan_out else t.double() - b.double()
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)  # [out, k], [k], [k, in]
            out.us[module], out.vh[module] = (u * s).to(t.dtype), vh.to(t.dtype)
            out.dtype = t.dtype
        else:
            out.dropped.append(name)
    config = json.loads((finetuned / "config.json").read_text())
    out.task_type = "CAUSAL_LM" if is_causal_lm(config.get("architectures")) else "SEQ_CLS"
    if not out.us:
        raise VariantIncompatible(f"{finetuned}: changes no matmul weight of its base; nothing for a LoRA to carry")
    return out


def write_lora(factors: DeltaFactors, rank: int, finetuned: Path, out_dir: Path) -> Path:
    """The rank-r adapter as a PEFT directory (and the fine-tune's config.json, for a classifier's labels)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ranks = {}
    for module in factors.us:
        r = factors.rank_of(module, rank)
        ranks[module] = r
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = factors.vh[module][:r].contiguous()
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = factors.us[module][:, :r].contiguous()
    tensors.update({_PREFIX + n: t.contiguous() for n, t in factors.head.items()})
    heads = sorted({n.split(".", 1)[0] for n in factors.head})
    pattern = {m: r for m, r in ranks.items() if r != rank}
    config = {"peft_type": "LORA", "task_type": factors.task_type, "r": rank, "lora_alpha": rank,
              "rank_pattern": pattern, "alpha_pattern": dict(pattern), "target_modules": sorted(factors.us),
              "modules_to_save": heads or None, "fan_in_fan_out": factors.fan_in_fan_out, "bias": "none",
              "lora_dropout": 0.0, "init_lora_weights": True}
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_tensors(out_dir / ADAPTER_WEIGHTS, tensors)
    if factors.head:
        shutil.copy2(finetuned / LABELS_CONFIG, out_dir / LABELS_CONFIG)
    return out_dir


def lowrank_state(fine_state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], factors: DeltaFactors,
                  rank: int) -> dict[str, torch.Tensor]:
    """The state dict that serving the rank-r adapter amounts to: base weights, B A added where the adapter
    targets, the fine-tune's head. What agreement is measured on, without a server."""
    names = set(base)
    out = {}
    for name, t in fine_state.items():
        if name.split(".", 1)[0] in HEAD_MODULES:
            out[name] = t
            continue
        target = match_base_name(name, names)
        value = base[target].to(t.dtype) if target is not None else t
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in factors.us:
            value = value + factors.correction(module, rank).to(t.dtype)
        out[name] = value
    return out
