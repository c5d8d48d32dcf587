"""Fused layers (serve/engine/fused.py) replace exactly transformers' Llama attention and SiLU MLP, and a forward
outside a generation step runs through them unchanged. (Inside a step, test_steps.py checks every request's
tokens against the same request alone, and test_mixed.py the logits against PEFT's.)"""

import copy

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from serve.engine.fused import GatedMLP, StepAttention, fuse_layers
from tests.models import write_tiny_causal


def test_every_llama_attention_and_mlp_is_fused_and_a_plain_forward_is_unchanged(tmp_path):
    plain = AutoModelForCausalLM.from_pretrained(write_tiny_causal(tmp_path / "m", layers=3)).eval()
    fused = copy.deepcopy(plain)
    assert fuse_layers(fused) == 6
    assert all(isinstance(layer.self_attn, StepAttention) and isinstance(layer.mlp, GatedMLP)
               for layer in fused.model.layers)
    assert fuse_layers(fused) == 0  # fused layers are not fused again
    assert list(fused.state_dict()) == list(plain.state_dict())  # the same modules, names and tensors
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        want = plain(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        got = fused(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        assert torch.equal(got.logits, want.logits)
        nxt = torch.tensor([[6]])
        assert torch.equal(fused(input_ids=nxt, past_key_values=got.past_key_values).logits,
                           plain(input_ids=nxt, past_key_values=want.past_key_values).logits)
