"""rotary_store: the twin is transformers' apply_rotary_pos_emb and the paged KV cache's write bit for bit; the Triton
form matches the twin, including the cache's untouched lanes."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.rotary import rotary_store_torch, rotary_store_triton

TOKENS, HEADS, KV_HEADS, DIM, BLOCKS, BLOCK_TOKENS = 5, 4, 2, 16, 3, 8


def inputs(dtype, device, gen):
    q = torch.randn(TOKENS, HEADS, DIM, generator=gen).to(dtype).to(device)
    k = torch.randn(TOKENS, KV_HEADS, DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(TOKENS, KV_HEADS, DIM, generator=gen).to(dtype).to(device)
    angles = torch.rand(TOKENS, DIM // 2, generator=gen) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    shape = (BLOCKS + 1, BLOCK_TOKENS, KV_HEADS, DIM)
    stores = [torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(2)]
    blocks = torch.tensor([0, 1, 2, 2, 3], device=device)  # two tokens of a prefill in block 2; block 3 is scratch
    offsets = torch.tensor([5, 0, 3, 4, 0], device=device)
    return q, k, v, cos, sin, *stores, blocks, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_twin_is_transformers_rotation_and_the_caches_write(dtype, gen):
    q, k, v, cos, sin, k_cache, v_cache, blocks, offsets = inputs(dtype, "cpu", gen)
    # transformers' layout: [1, H, T, D] and cos/sin [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_k_cache[blocks, offsets] = want_k[0].transpose(0, 1)
    want_v_cache[blocks, offsets] = v
    k_before = k.clone()
    out = rotary_store_torch(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
    assert out is q and torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin(dtype, triton_device, gen, tolerances):
    args = inputs(dtype, triton_device, gen)
    want = [t.clone() for t in args]
    rotary_store_torch(*want)
    rotary_store_triton(*args)
    for got, exp in zip(args[:7], want[:7]):  # q, k, v, cos, sin, both caches, every lane
        torch.testing.assert_close(got, exp, **tolerances[dtype])


def test_bad_shapes_fail_with_one_clear_line(gen):
    q, k, v, cos, sin, k_cache, v_cache, blocks, offsets = inputs(torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="cos: expected"):
        rotary_store_torch(q, k, v, cos[:, :4], sin, k_cache, v_cache, blocks, offsets)
    with pytest.raises(ValueError, match="k_cache: expected"):
        rotary_store_triton(q, k, v, cos, sin, k_cache[:, :, :1], v_cache, blocks, offsets)
    with pytest.raises(ValueError, match="offsets: expected"):
        rotary_store_torch(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets[:2])
