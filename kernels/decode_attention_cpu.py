"""Decode attention on the CPU: what a CPU server runs for fp32 caches (decode_attention_numba, beside its torch
reference kernels/decode_attention.py: decode_attention_torch, with the same signature and semantics).

It reads each row's keys and values where its blocks lie, as the Triton kernel does, in one compiled loop over
(row, key/value head) pairs split over the cores, an online softmax over STEP positions at a time. The twin
gathers the rows' blocks into one copy first and then runs SDPA: at 64 rows of 512 positions of SmolLM2's heads
over a 2 GB cache, 29 ms a layer against this loop's 9 (2-core CPU), the copy costing more than the attention.
STEP does not depend on the block size, so a row's output is the same, bit for bit, in blocks of 16 and in one
block of its whole context; it sums in another order than the twin (equal up to fp32 rounding).
"""

import math

import numpy as np
import torch
from numba import njit, prange

from kernels.decode_attention import _check

STEP = 16
"""Positions an online-softmax step takes (any block size: a step may span blocks)."""


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, lengths: np.ndarray, scale: float,
            out: np.ndarray) -> None:
    """q [B, H, D], k, v [NB, BT, KVH, D], tables [R, W], lengths [B] -> out [B, H, D]: the H / KVH query heads
    that share a key/value head are one task, and read each key and value once."""
    rows, heads, dim = q.shape
    block = k.shape[1]
    kv_heads = k.shape[2]
    group = heads // kv_heads
    for task in prange(rows * kv_heads):
        b = task // kv_heads
        j = task % kv_heads
        n = lengths[b]
        acc = np.zeros((group, dim), dtype=np.float32)
        if n > 0:
            qg = np.empty((group, dim), dtype=np.float32)
            for g in range(group):
                for d in range(dim):
                    qg[g, d] = q[b, j * group + g, d] * scale
            most = np.full(group, -np.inf, dtype=np.float32)
            total = np.zeros(group, dtype=np.float32)
            s = np.empty((group, STEP), dtype=np.float32)
            for start in range(0, n, STEP):
                count = min(STEP, n - start)
                for i in range(count):
                    p = start + i
                    blk = tables[b, p // block]
                    at = p % block
                    for g in range(group):
                        a = np.float32(0.0)
                        for d in range(dim):
                            a += qg[g, d] * k[blk, at, j, d]
                        s[g, i] = a
                for g in range(group):
                    m = most[g]
                    for i in range(count):
                        m = max(m, s[g, i])
                    shrink = math.exp(most[g] - m) if most[g] > -np.inf else np.float32(0.0)
                    most[g] = m
                    total[g] *= shrink
                    for d in range(dim):
                        acc[g, d] *= shrink
                    for i in range(count):
                        s[g, i] = math.exp(s[g, i] - m)
                        total[g] += s[g, i]
                for i in range(count):
                    p = start + i
                    blk = tables[b, p // block]
                    at = p % block
                    for g in range(group):
                        w = s[g, i]
                        for d in range(dim):
                            acc[g, d] += w * v[blk, at, j, d]
            for g in range(group):
                inv = np.float32(1.0) / total[g]
                for d in range(dim):
                    acc[g, d] *= inv
        for g in range(group):
            for d in range(dim):
                out[b, j * group + g, d] = acc[g, d]


def decode_attention_numba(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float, max_length: int
                           ) -> torch.Tensor:
    """CPU serving's form for fp32 caches: the twin's contract, checked the same way; max_length is not read (each
    row stops at its own length). -> a new [B, H, D]."""
    _check(q, k_cache, v_cache, block_tables, lengths)
    if q.dtype != torch.float32 or q.is_cuda:
        raise ValueError(f"decode_attention_numba: expected fp32 CPU tensors; got {q.dtype} on {q.device}")
    o = torch.empty_like(q)
    if q.shape[0]:
        _decode(q.numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(), lengths.numpy(), float(scale),
                o.numpy())
    return o
