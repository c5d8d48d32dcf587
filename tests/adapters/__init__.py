"""Helpers of the adapter tests: a tiny Llama whose fp32 forward noise sits below the tolerances tested, and the
toy task the Trans-LoRA tests move (conftest.py trains its adapter)."""

import random
from pathlib import Path

import torch

from serve.adapters.data import PromptExample
from tests.models import WORDS, write_tiny_causal

VOCAB = WORDS[7:]


def write_tiny_lm(path: Path, seed: int = 0, std: float = 0.2) -> Path:
    """tests.models' tiny Llama with weights at std 0.2 rather than 1: its logits stay near 1, so fp32 forward
    noise (~1e-6) sits well below the 1e-5 the conversion tests hold it to (at std 1 it is ~1e-5)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tiny_causal(path, seed)
    config = LlamaConfig.from_pretrained(path)
    config.initializer_range = std
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def toy_task(n: int = 24, seed: int = 0) -> list[PromptExample]:
    """Five words, then " yes" if the first is in the first half of the vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(VOCAB, k=5)
        out.append(PromptExample(prompt=" ".join(words), completion=" yes" if VOCAB.index(words[0]) < 30 else " no"))
    return out
