import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tiny_state(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A tiny 2-layer model's tensors: what a base looks like to the codec."""
    out = {"embed.weight": torch.randn(50, 8, generator=gen) * 0.02}
    for i in range(2):
        out[f"layers.{i}.attn.weight"] = torch.randn(24, 8, generator=gen) * 0.05
        out[f"layers.{i}.mlp.weight"] = torch.randn(32, 8, generator=gen) * 0.05
        out[f"layers.{i}.norm.weight"] = torch.ones(8)
    return {k: v.to(dtype) for k, v in out.items()}


def finetune_of(base: dict[str, torch.Tensor], gen: torch.Generator, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """A plausible fine-tune: small dense updates, one frozen tensor, a new head."""
    out = {}
    for k, v in base.items():
        if k == "layers.0.norm.weight":
            out[k] = v.clone()
        else:
            out[k] = (v.float() + torch.randn(v.shape, generator=gen) * scale).to(v.dtype)
    out["head.weight"] = torch.randn(3, 8, generator=gen).to(next(iter(base.values())).dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8)))
