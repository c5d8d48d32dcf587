"""Fused layers (serve/engine/step/fused.py) replace exactly transformers' Llama attention and SiLU MLP, and a forward
outside a generation step runs through them unchanged. (Inside a step, test_steps.py checks every request's
tokens against the same request alone, and test_mixed.py the logits against PEFT's.)"""

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from serve.engine.step.fused import GatedMLP, StepAttention, fuse_layers
from tests.models import write_tiny_causal


def test_every_llama_attention_and_mlp_is_fused_and_a_plain_forward_is_unchanged(tmp_path):
    # Fused in place, over the very tensors the plain forward read: a copy's other alignment can change a one-token
    # matmul's last bits on some CPUs, which would be no fault of the fused layers.
    model = AutoModelForCausalLM.from_pretrained(write_tiny_causal(tmp_path / "m", layers=3)).eval()
    ids, nxt = torch.tensor([[1, 5, 9, 4, 7, 3]]), torch.tensor([[6]])
    with torch.no_grad():
        want = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        want_next = model(input_ids=nxt, past_key_values=want.past_key_values).logits
    names = list(model.state_dict())
    assert fuse_layers(model) == 6
    assert all(isinstance(layer.self_attn, StepAttention) and isinstance(layer.mlp, GatedMLP)
               for layer in model.model.layers)
    assert fuse_layers(model) == 0  # fused layers are not fused again
    assert list(model.state_dict()) == names  # the same modules, names and tensors
    with torch.no_grad():
        got = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        assert torch.equal(got.logits, want.logits)
        assert torch.equal(model(input_ids=nxt, past_key_values=got.past_key_values).logits, want_next)
