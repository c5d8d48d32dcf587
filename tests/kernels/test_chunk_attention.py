"""chunk_attention: the Triton form against its twin, and the twin against causal attention token by token, over
paged caches whose blocks are shuffled."""

import pytest
import torch

from kernels.chunk_attention import chunk_attention_torch, chunk_attention_triton
from tests.kernels.paged import paged

# (heads, kv heads, head dim, rows, positions, block tokens, chunks as (start, length, row, first)); odd sizes,
# padding chunks (length 0), a chunk that starts mid-prompt (first > 0), one longer than a query block, blocks
# smaller than a key step and one block a row (the slot layout).
CASES = {
    "two-chunks": (6, 2, 24, 4, 70, 16, [(2, 5, 1, 0), (7, 3, 3, 9), (0, 0, 0, 0)]),
    "long-mid-prompt": (4, 4, 16, 3, 80, 5, [(0, 37, 2, 20), (37, 1, 0, 0)]),
    "gqa-three": (9, 3, 64, 2, 40, 40, [(1, 17, 0, 3), (0, 0, 0, 0), (0, 0, 0, 0)]),
}


def make_inputs(case, dtype, device, gen):
    heads, kv_heads, dim, rows, positions, block_tokens, chunks = case
    tokens = max(s + n for s, n, _, _ in chunks) + 2  # two tokens in no chunk (decode rows, padding)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k_cache, v_cache, tables, k, v = paged(rows, kv_heads, positions, dim, block_tokens, dtype, gen)
    o = torch.full_like(q, 7.0)
    table = torch.tensor(chunks, dtype=torch.int64)
    return [t.to(device) for t in (q, k_cache, v_cache, tables, table, o, k, v)]


def by_token(q, k, v, chunks, scale, o):
    """Each chunk token alone: its query over its row's contiguous keys up to its own position, repeated per head."""
    out = o.double().clone()
    group = q.shape[1] // k.shape[1]
    for start, length, row, first in chunks.tolist():
        for i in range(length):
            n = first + i + 1
            keys = k[row, :, :n].double().repeat_interleave(group, 0)  # [H, n, D]
            values = v[row, :, :n].double().repeat_interleave(group, 0)
            weights = torch.softmax(scale * q[start + i].double()[:, None, :] @ keys.transpose(1, 2), -1)
            out[start + i] = (weights @ values)[:, 0]
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_twin_equals_causal_attention_token_by_token(case, gen):
    q, k_cache, v_cache, tables, chunks, o, k, v = make_inputs(case, torch.float32, "cpu", gen)
    want = by_token(q, k, v, chunks, 0.3, o)
    got = chunk_attention_torch(q, k_cache, v_cache, tables, chunks, 0.3, 64, o.clone())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin_and_leaves_other_tokens_alone(case, dtype, triton_device, gen, tolerances):
    q, k_cache, v_cache, tables, chunks, o, _, _ = make_inputs(case, dtype, triton_device, gen)
    longest = int(chunks[:, 1].max())
    want = chunk_attention_torch(q, k_cache, v_cache, tables, chunks, 0.3, longest, o.clone())
    got = chunk_attention_triton(q, k_cache, v_cache, tables, chunks, 0.3, longest + 5, o.clone())  # a wider grid
    torch.testing.assert_close(got, want, **tolerances[dtype])
    assert (got[-2:] == 7.0).all()  # tokens of no chunk keep what o held


def test_bad_calls_are_one_line(gen):
    q, k_cache, v_cache, tables, chunks, o, _, _ = make_inputs(CASES["two-chunks"], torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match=r"chunks: expected a contiguous \[C, 4\] int64"):
        chunk_attention_torch(q, k_cache, v_cache, tables, chunks.int(), 1.0, 8, o)
    with pytest.raises(ValueError, match="heads do not split"):
        chunk_attention_torch(q[:, :5], k_cache, v_cache, tables, chunks, 1.0, 8, o[:, :5])
    with pytest.raises(ValueError, match="block_tables: expected"):
        chunk_attention_torch(q, k_cache, v_cache, tables.int(), chunks, 1.0, 8, o)
