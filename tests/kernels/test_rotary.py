"""rotary_store: the twin is transformers' apply_rotary_pos_emb and the KV store's write bit for bit; the Triton
form matches the twin, including the store's untouched lanes."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.rotary import rotary_store_torch, rotary_store_triton

TOKENS, HEADS, KV_HEADS, DIM, SLOTS, POSITIONS = 5, 4, 2, 16, 3, 8


def inputs(dtype, device, gen):
    q = torch.randn(TOKENS, HEADS, DIM, generator=gen).to(dtype).to(device)
    k = torch.randn(TOKENS, KV_HEADS, DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(TOKENS, KV_HEADS, DIM, generator=gen).to(dtype).to(device)
    angles = torch.rand(TOKENS, DIM // 2, generator=gen) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    stores = [torch.randn(SLOTS + 1, KV_HEADS, POSITIONS, DIM, generator=gen).to(dtype).to(device) for _ in range(2)]
    slots = torch.tensor([0, 1, 2, 2, 3], device=device)  # two tokens of slot 2's prefill; slot 3 is scratch
    positions = torch.tensor([5, 0, 3, 4, 0], device=device)
    return q, k, v, cos, sin, *stores, slots, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_twin_is_transformers_rotation_and_the_stores_write(dtype, gen):
    q, k, v, cos, sin, k_store, v_store, slots, positions = inputs(dtype, "cpu", gen)
    # transformers' layout: [1, H, T, D] and cos/sin [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_k_store, want_v_store = k_store.clone(), v_store.clone()
    want_k_store[slots, :, positions] = want_k[0].transpose(0, 1)
    want_v_store[slots, :, positions] = v
    k_before = k.clone()
    out = rotary_store_torch(q, k, v, cos, sin, k_store, v_store, slots, positions)
    assert out is q and torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(k_store, want_k_store) and torch.equal(v_store, want_v_store)
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin(dtype, triton_device, gen, tolerances):
    args = inputs(dtype, triton_device, gen)
    want = [t.clone() for t in args]
    rotary_store_torch(*want)
    rotary_store_triton(*args)
    for got, exp in zip(args[:7], want[:7]):  # q, k, v, cos, sin, both stores, every lane
        torch.testing.assert_close(got, exp, **tolerances[dtype])


def test_bad_shapes_fail_with_one_clear_line(gen):
    q, k, v, cos, sin, k_store, v_store, slots, positions = inputs(torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="cos: expected"):
        rotary_store_torch(q, k, v, cos[:, :4], sin, k_store, v_store, slots, positions)
    with pytest.raises(ValueError, match="k_store: expected"):
        rotary_store_triton(q, k, v, cos, sin, k_store[:, :1], v_store, slots, positions)
    with pytest.raises(ValueError, match="positions: expected"):
        rotary_store_torch(q, k, v, cos, sin, k_store, v_store, slots, positions[:2])
