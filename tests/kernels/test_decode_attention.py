"""decode_attention: the Triton form against its twin, and the twin against attention computed row by row, over
paged caches whose blocks are shuffled."""

import pytest
import torch

from kernels.decode_attention import decode_attention_torch, decode_attention_triton
from kernels.decode_attention_cpu import decode_attention_numba
from tests.kernels.paged import lay_over, paged

# (rows, heads, kv heads, head dim, positions, block tokens); odd sizes, a padding row (length 0), a full one, blocks
# smaller than the kernel's key step and one block a row (the slot layout).
SHAPES = [(5, 6, 2, 24, 70, 16), (3, 4, 4, 16, 33, 5), (4, 9, 3, 64, 130, 130), (2, 4, 2, 16, 40, 64)]


def make_inputs(shape, dtype, device, gen):
    rows, heads, kv_heads, dim, positions, block_tokens = shape
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k_cache, v_cache, tables, k, v = paged(rows, kv_heads, positions, dim, block_tokens, dtype, gen)
    lengths = torch.randint(1, positions + 1, (rows,), generator=gen)
    lengths[0], lengths[-1] = 0, positions
    return [t.to(device) for t in (q, k_cache, v_cache, tables, lengths, k, v)]


def by_row(q, k, v, lengths, scale):
    """Attention of each row alone over its contiguous keys, repeated per query head as transformers' eager
    attention does."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        keys = k[b, :, :n].double().repeat_interleave(group, 0)  # [H, n, D]
        values = v[b, :, :n].double().repeat_interleave(group, 0)
        weights = torch.softmax(scale * q[b].double()[:, None, :] @ keys.transpose(1, 2), -1)  # [H, 1, n]
        out[b] = (weights @ values)[:, 0]
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_the_twin_equals_attention_row_by_row(shape, gen):
    q, k_cache, v_cache, tables, lengths, k, v = make_inputs(shape, torch.float32, "cpu", gen)
    got = decode_attention_torch(q, k_cache, v_cache, tables, lengths, 0.3, int(lengths.max()))
    torch.testing.assert_close(got.double(), by_row(q, k, v, lengths, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin(shape, dtype, triton_device, gen, tolerances):
    q, k_cache, v_cache, tables, lengths, _, _ = make_inputs(shape, dtype, triton_device, gen)
    want = decode_attention_torch(q, k_cache, v_cache, tables, lengths, 0.3, int(lengths.max()))
    got = decode_attention_triton(q, k_cache, v_cache, tables, lengths, 0.3, 0)  # it reads lengths on the device
    torch.testing.assert_close(got, want, **tolerances[dtype])
    assert got[0].abs().max() == 0  # a padding row is zero


@pytest.mark.parametrize("shape", SHAPES)
def test_the_cpu_form_equals_the_twin(shape, gen):
    q, k_cache, v_cache, tables, lengths, _, _ = make_inputs(shape, torch.float32, "cpu", gen)
    want = decode_attention_torch(q, k_cache, v_cache, tables, lengths, 0.3, int(lengths.max()))
    got = decode_attention_numba(q, k_cache, v_cache, tables, lengths, 0.3, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0].abs().max() == 0


def test_the_cpu_form_gives_a_row_the_same_bits_in_any_block_size(gen):
    """The same rows in blocks of 16, of 5 and in one block of their whole context: the same output, bit for bit
    (what makes the engine's paged and slot layouts, and prefix caching on and off, give the same tokens)."""
    rows, heads, kv_heads, dim, positions = 3, 6, 2, 24, 70
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, positions, dim, generator=gen) for _ in range(2))
    lengths = torch.tensor([70, 33, 1])
    outs = []
    for block in (16, 5, 70):
        k_cache, v_cache, tables = lay_over(k, v, block, gen)
        outs.append(decode_attention_numba(q, k_cache, v_cache, tables, lengths, 0.3, 0))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_calls_are_one_line(gen):
    q, k_cache, v_cache, tables, lengths, _, _ = make_inputs(SHAPES[0], torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="heads do not split"):
        decode_attention_torch(q[:, :5], k_cache, v_cache, tables, lengths, 1.0, 4)
    with pytest.raises(ValueError, match=r"lengths: expected \[5\] int32 or int64"):
        decode_attention_torch(q, k_cache, v_cache, tables, lengths.float(), 1.0, 4)
    with pytest.raises(ValueError, match=r"block_tables: expected \[R >= 5, W\] int64"):
        decode_attention_torch(q, k_cache, v_cache, tables[:3], lengths, 1.0, 4)
