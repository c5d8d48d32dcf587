"""Transformers layers that a generation step runs in fewer launches: Llama's attention (the rotary embedding and
the KV cache's write in one kernel) and its MLP (SiLU and the product in one).

Captured in a CUDA graph, a decode step of Llama-3-8B at 64 rows spent 1.1 of its 11.1 ms on the rotation's ten
kernels and the store's two writes a layer, and 0.16 ms on the activation's two: every one of those kernels
costs its ramp, not its bytes. Each fused form is a subclass of transformers' layer that only overrides forward:
it runs the layer's own projections (so every correction family still applies to them) and computes what the
layer computes, with the same roundings (kernels.rotary_store, kernels.silu_mul); an attention forward outside a
generation step runs transformers' code, as does any model whose layers are not these exact classes. This is what
transformers' own kernel hub does for layers it knows (`use_kernel_forward_from_hub` swaps their forward), and
what vLLM's model code does throughout.
"""

import torch
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from kernels import rotary_store, silu_mul
from serve.engine.kv.store import KVStore, StepLayout, attend


class StepAttention(LlamaAttention):
    """LlamaAttention; in a generation step, q, k and v rotated and stored by one kernel, then read from the
    cache as kv/store.py's attend reads it."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                kv_layout: StepLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        if kv_layout is None or not isinstance(past_key_values, KVStore):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        tokens = hidden_states.shape[1]  # a step is one sequence of every row's tokens: [1, T, hidden]
        q = self.q_proj(hidden_states).view(tokens, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(tokens, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(tokens, -1, self.head_dim)
        cos, sin = position_embeddings  # [1, T, D]
        layer = past_key_values.layers[self.layer_idx]
        rotary_store(q, k, v, cos[0], sin[0], layer.keys, layer.values, kv_layout.write_blocks,
                     kv_layout.write_offsets)
        out = attend(q, layer.keys, layer.values, kv_layout, self.scaling)  # [T, H, D]
        return self.o_proj(out.reshape(1, tokens, -1)), None


class GatedMLP(LlamaMLP):
    """LlamaMLP with SiLU: down(silu(gate(x)) * up(x)), the activation and the product in one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def fuse_layers(model: torch.nn.Module) -> int:
    """Every Llama attention and SiLU MLP of `model` becomes its fused form in place (its class swapped: the
    module keeps its children, names and tensors); -> how many did."""
    fused = 0
    for module in model.modules():
        if type(module) is LlamaAttention:
            module.__class__ = StepAttention
        elif type(module) is LlamaMLP and module.config.hidden_act == "silu":
            module.__class__ = GatedMLP
        else:
            continue
        fused += 1
    return fused
